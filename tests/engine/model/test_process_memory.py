"""Resident memory read from a /proc status file."""

from __future__ import annotations

import platform

import pytest

from nanoserve.engine.model.process_memory import ProcessMemory, process_memory, release_free_heap


def test_reads_rss_and_peak_in_bytes(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n")
    assert process_memory(str(status)) == ProcessMemory(rss_bytes=1024 * 1024, peak_rss_bytes=2048 * 1024)


def test_none_where_the_status_cannot_be_read(tmp_path):
    assert process_memory(str(tmp_path / "missing")) is None
    partial = tmp_path / "partial"
    partial.write_text("VmRSS:\t1024 kB\n")
    assert process_memory(str(partial)) is None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_heap_trims_glibc_heap():
    assert release_free_heap()
