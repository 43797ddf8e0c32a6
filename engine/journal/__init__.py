"""The request journal: what each request was asked and released, written with its step's events; crash recovery."""
