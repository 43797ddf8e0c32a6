"""Pictures of the allocation log (matplotlib): the block map over time, the pool at one seq."""
