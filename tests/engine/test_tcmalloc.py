"""tcmalloc chosen for CPU engine processes (kvserve/engine/tcmalloc.py): the setting, the
LD_PRELOAD a spawned engine core gets, and the hint for in-process engines. The real
process (``kvserve serve``'s engine core mapping the library) is in
test_engine_core_proc.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvserve.engine import tcmalloc


def test_setting_chooses_found_none_or_a_file(tmp_path):
    found = tcmalloc.find_tcmalloc()
    assert tcmalloc.choose(None) == tcmalloc.TcmallocChoice(found)
    assert tcmalloc.choose("1") == tcmalloc.TcmallocChoice(found)
    assert tcmalloc.choose("0") == tcmalloc.TcmallocChoice(None, disabled=True)
    lib = tmp_path / "libtcmalloc_custom.so"
    lib.write_bytes(b"")
    assert tcmalloc.choose(str(lib)) == tcmalloc.TcmallocChoice(str(lib))
    with pytest.raises(ValueError, match=r"KVSERVE_TCMALLOC=.*not a file"):
        tcmalloc.choose(str(tmp_path / "missing.so"))


def test_preload_value_puts_the_library_first_once():
    assert tcmalloc.preload_value(None, "/l/libtcmalloc.so") == "/l/libtcmalloc.so"
    assert tcmalloc.preload_value("", "/l/libtcmalloc.so") == "/l/libtcmalloc.so"
    assert tcmalloc.preload_value("/x/a.so", "/l/libtcmalloc.so") == "/l/libtcmalloc.so:/x/a.so"
    mine = "/opt/libtcmalloc_minimal.so.4:/x/a.so"
    assert tcmalloc.preload_value(mine, "/l/libtcmalloc.so") == mine  # the user's choice wins


@pytest.mark.parametrize("before", [None, "/x/a.so"])
def test_children_get_the_library_and_the_parent_its_environment_back(
    tmp_path, monkeypatch, before
):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setenv("KVSERVE_TCMALLOC", str(lib))
    monkeypatch.delenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", raising=False)
    if before is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", before)
    with tcmalloc.preloaded_for_children("cpu") as used:
        assert used == str(lib)
        assert os.environ["LD_PRELOAD"] == tcmalloc.preload_value(before, str(lib))
        assert int(os.environ["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert os.environ.get("LD_PRELOAD") == before
    assert "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in os.environ


def test_nothing_changes_off_cpu_when_disabled_or_already_preloaded(tmp_path, monkeypatch):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/x/a.so")
    monkeypatch.setenv("KVSERVE_TCMALLOC", str(lib))
    with tcmalloc.preloaded_for_children("cuda") as used:
        assert used is None and os.environ["LD_PRELOAD"] == "/x/a.so"
    monkeypatch.setenv("KVSERVE_TCMALLOC", "0")
    with tcmalloc.preloaded_for_children("cpu") as used:
        assert used is None and os.environ["LD_PRELOAD"] == "/x/a.so"
    monkeypatch.setenv("KVSERVE_TCMALLOC", "1")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so.4")
    with tcmalloc.preloaded_for_children("cpu") as used:
        assert used is None and os.environ["LD_PRELOAD"] == "/opt/libtcmalloc.so.4"
    monkeypatch.setenv("KVSERVE_TCMALLOC", str(tmp_path / "missing.so"))
    with pytest.raises(ValueError, match="not a file"), tcmalloc.preloaded_for_children("cpu"):
        pass


def test_loaded_reads_this_process_maps():
    maps = Path("/proc/self/maps").read_text()
    assert tcmalloc.loaded() == ("tcmalloc" in maps)
    assert tcmalloc.loaded(2**31) is False  # no such process


def test_in_process_hint_is_logged_once_unless_disabled(tmp_path, monkeypatch, caplog):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(tcmalloc, "loaded", lambda pid="self": False)
    monkeypatch.setattr(tcmalloc, "_hinted", False)
    monkeypatch.setenv("KVSERVE_TCMALLOC", str(lib))
    with caplog.at_level(logging.INFO, logger="kvserve.engine.tcmalloc"):
        tcmalloc.hint_in_process("cuda")
        assert not caplog.records
        tcmalloc.hint_in_process("cpu")
        tcmalloc.hint_in_process("cpu")
    assert len(caplog.records) == 1 and f"LD_PRELOAD={lib}" in caplog.records[0].message
    caplog.clear()
    monkeypatch.setattr(tcmalloc, "_hinted", False)
    monkeypatch.setenv("KVSERVE_TCMALLOC", "0")
    with caplog.at_level(logging.INFO, logger="kvserve.engine.tcmalloc"):
        tcmalloc.hint_in_process("cpu")
    assert not caplog.records
