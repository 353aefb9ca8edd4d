"""hyperpar.log: rank-0-only output, the quiet switch, the progress line."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from hyperpar import log as hlog


@pytest.fixture(autouse=True)
def _not_forced_quiet():
    hlog.set_quiet(None)
    yield
    hlog.set_quiet(None)


def test_logger_prints_on_rank_zero():
    stream = io.StringIO()
    hlog.get_logger("hyperpar.test.r0", stream=stream).info("hello %d", 1)
    assert stream.getvalue() == "hello 1\n"


def test_logger_is_silent_on_other_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    stream = io.StringIO()
    hlog.get_logger("hyperpar.test.r1", stream=stream).info("hello")
    assert stream.getvalue() == ""


def test_all_ranks_logger_prefixes_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    stream = io.StringIO()
    hlog.get_logger("hyperpar.test.all", all_ranks=True, stream=stream).info("hi")
    assert stream.getvalue() == "[rank 3] hi\n"


def test_quiet_env_silences_info_but_not_warnings(monkeypatch):
    monkeypatch.setenv("HYPERPAR_QUIET", "1")
    stream = io.StringIO()
    log = hlog.get_logger("hyperpar.test.quiet", stream=stream)
    log.info("chatter")
    log.warning("careful")
    assert stream.getvalue() == "careful\n"


def test_set_quiet_overrides_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("HYPERPAR_QUIET", "1")
    hlog.set_quiet(False)
    hlog.log_progress(1, 0.5)
    assert capsys.readouterr().out == "step 1 | loss 0.5000\n"


def test_progress_line_shows_step_loss_and_throughput():
    line = hlog.progress_line(10, torch.tensor(2.3013), 51200.4, total_steps=100, lr=3e-4)
    assert line == "step  10/100 | loss 2.3013 | 51,200 tok/s | lr 3.0e-04"


def test_progress_prints_every_n_steps_and_the_last(capsys):
    progress = hlog.Progress(total_steps=5, tokens_per_step=64, every=2)
    lines = [progress.step(1.0) for _ in range(5)]
    assert [line is not None for line in lines] == [False, True, False, True, True]
    out = capsys.readouterr().out.splitlines()
    assert [o.split(" | ")[0] for o in out] == ["step 2/5", "step 4/5", "step 5/5"]
    assert all("tok/s" in o and "ms/step" in o for o in out)


def test_progress_is_silent_when_quiet(capsys):
    hlog.set_quiet(True)
    hlog.Progress(total_steps=1).step(1.0)
    hlog.rank0_print("not shown")
    hlog.rank0_print("shown", force=True)
    assert capsys.readouterr().out == "shown\n"


def test_child_loggers_are_filtered_by_rank_too(monkeypatch):
    stream = io.StringIO()
    hlog.get_logger("hyperpar.test.parent", stream=stream)
    monkeypatch.setenv("RANK", "1")
    logging.getLogger("hyperpar.test.parent.child").warning("from rank 1")
    monkeypatch.setenv("RANK", "0")
    logging.getLogger("hyperpar.test.parent.child").warning("from rank 0")
    assert stream.getvalue() == "from rank 0\n"
