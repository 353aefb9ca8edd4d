"""``hyperpar plan``: the command end to end, its JSON schema, the plot, bad input, and that the
planner imports no framework."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hyperpar.cli import main

from ._common import LLAMA2_7B, ROOT

LAYOUT_KEYS = {"name", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "etp", "cp_shard",
               "microbatches",
               "activation_checkpointing", "ac_every", "selective_ac", "loss_parallel", "memory",
               "predicted_step_ms", "time"}
TIME_KEYS = {"compute_ms", "bubble_ms", "tp_ms", "pp_ms", "fsdp_exposed_ms", "dp_exposed_ms",
             "optimizer_ms"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "peak", "grads_at_peak"}


def _plan(*extra: str) -> list[str]:
    return ["plan", "--config", str(LLAMA2_7B), "--world", "64", "--seq-len", "4096",
            "--global-batch", "64", *extra]


def test_json_schema(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(_plan("--json", str(out))) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"schema_version", "parameters", "device_memory", "layouts", "ruled_out"}
    assert doc["parameters"] == 6_738_415_616
    assert doc["layouts"]
    for lay in doc["layouts"]:
        assert set(lay) == LAYOUT_KEYS
        assert set(lay["memory"]) == MEMORY_KEYS
        assert set(lay["time"]) == TIME_KEYS
        mem = lay["memory"]
        assert all(isinstance(v, int) for v in mem.values())
        assert isinstance(mem["grads_at_peak"], bool)
        grads = mem["grads"] if mem["grads_at_peak"] else 0
        assert mem["peak"] == mem["params"] + mem["optimizer"] + mem["activations"] + grads
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] * lay["cp"] == 64
    steps = [lay["predicted_step_ms"] for lay in doc["layouts"]]
    assert steps == sorted(steps)


def test_table_and_ruled_out_are_printed(capsys) -> None:
    assert main(_plan("--top", "3")) == 0
    text = capsys.readouterr().out
    assert "6,738,415,616 parameters" in text
    assert "step ms" in text and "layouts ruled out" in text
    assert "num_attention_heads=32 % tp=" not in text or "dims that do not divide" in text


def test_svg_plot_without_matplotlib(tmp_path) -> None:
    from hyperpar.plan import from_hf_config, get_profile, plan, plot
    from hyperpar.plan.layout import Run

    result = plan(from_hf_config(LLAMA2_7B), Run(world=8, seq_len=2048, global_batch=8),
                  get_profile("a100"))
    written = plot(result, tmp_path / "f.png", force_svg=True)
    assert written.suffix == ".svg"
    text = written.read_text()
    assert text.startswith("<svg") and "<polyline" in text


def test_example_model_plans(capsys) -> None:
    assert main(["plan", "--example", "tiny", "--world", "4", "--seq-len", "16",
                 "--global-batch", "8", "--param-dtype", "float32", "--device", "910b"]) == 0
    assert "examples/llama tiny" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--device-memory", "80 parsecs"], "device memory '80 parsecs' not understood"),
    (["--device", "tpu9"], "unknown device 'tpu9'"),
])
def test_bad_input_is_named(args, message, capsys) -> None:
    try:
        code = main(_plan(*args))
    except SystemExit as exc:  # argparse reports type errors by exiting
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file_is_named(capsys) -> None:
    assert main(["plan", "--config", "nope.json", "--world", "8", "--seq-len", "8",
                 "--global-batch", "8"]) == 2
    assert "'nope.json' does not exist" in capsys.readouterr().err


def test_planner_imports_no_framework() -> None:
    code = ("import sys, hyperpar, hyperpar.plan, hyperpar.plan.cli\n"
            "from hyperpar.cli import main\n"
            f"assert main(['plan', '--config', {str(LLAMA2_7B)!r}, '--world', '16', "
            "'--seq-len', '2048', '--global-batch', '16']) == 0\n"
            "assert 'torch' not in sys.modules, 'hyperpar.plan imported torch'\n"
            "assert 'mindspore' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_profile_file_round_trips_and_bad_keys_are_named(tmp_path, capsys) -> None:
    from hyperpar.plan.devices import get_profile, load_profile, save_profile

    path = tmp_path / "mine.json"
    save_profile(get_profile("a100"), path)
    assert load_profile(path) == get_profile("a100")
    assert main(_plan("--profile", str(path))) == 0
    assert "NVIDIA A100" in capsys.readouterr().out
    path.write_text('{"name": "x", "flops": 1}')
    with pytest.raises(ValueError, match=r"unknown keys \['flops'\]"):
        load_profile(path)


def test_json_carries_ruled_out_layouts_with_numbers(tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(_plan("--json", str(out))) == 0
    doc = json.loads(out.read_text())
    kinds = {x["kind"] for x in doc["ruled_out"]}
    assert kinds == {"oom", "divisibility"}
    for x in doc["ruled_out"]:
        assert x["reason"]
        if x["kind"] == "oom":
            assert x["memory"]["peak"] - doc["device_memory"] == x["over_bytes"] > 0
            assert x["predicted_step_ms"] > 0 and set(x["time"]) == TIME_KEYS
        else:
            assert "memory" not in x
    # the reasons name the dims: tp=64 does not divide 32 heads
    assert any("num_attention_heads=32 % tp=64" in x["reason"] for x in doc["ruled_out"])


def test_device_memory_units_one_rule() -> None:
    from hyperpar.plan.cli import parse_bytes

    assert parse_bytes("80GB") == 80 * 10**9          # decimal, as vendors print it
    assert parse_bytes("80GiB") == 80 * 2**30         # binary
    assert parse_bytes("80G") == parse_bytes("80gib")  # bare letters are binary
    assert parse_bytes("512MB") == 512 * 10**6 and parse_bytes("512MiB") == 512 * 2**20
    doc = (ROOT / "docs" / "planning.md").read_text()
    assert "`80GB` = 80·10⁹ bytes" in doc and "`80GiB` = `80G` = 80·2³⁰ bytes" in doc


def test_device_memory_80gb_is_applied_as_decimal(capsys) -> None:
    # 80 GB = 74.51 GiB is the limit the layout is checked against
    assert main(_plan("--device-memory", "80GB", "--layout", "dp64.mb1")) == 1
    assert "device memory 74.51 GiB" in capsys.readouterr().out


def test_json_survives_a_reader_that_leaves(tmp_path) -> None:
    """`hyperpar plan ... --json out.json | head -1`: the JSON is written, no traceback."""
    out = tmp_path / "plan.json"
    proc = subprocess.Popen([sys.executable, "-m", "hyperpar.plan.cli", *_plan(
        "--json", str(out), "--top", "200")[1:]], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert json.loads(out.read_text())["layouts"]


def test_one_layout_is_evaluated_even_when_it_does_not_fit(tmp_path, capsys) -> None:
    out = tmp_path / "one.json"
    assert main(_plan("--layout", "dp64.mb1", "--json", str(out))) == 1
    text = capsys.readouterr().out
    assert "layout dp64.mb1:" in text and "does not run: OOM by" in text
    assert "step" in text and "activations" in text
    doc = json.loads(out.read_text())
    assert doc["layouts"] == [] and len(doc["ruled_out"]) == 1
    assert doc["ruled_out"][0]["over_bytes"] > 0
    assert main(_plan("--layout", "fsdp64.mb1")) == 0
    assert "fits" in capsys.readouterr().out
    assert main(_plan("--layout", "tp64.mb1")) == 1
    assert "num_attention_heads=32 % tp=64" in capsys.readouterr().out


@pytest.mark.parametrize("name,message", [
    ("dp8.fsdp4.mb1", "has 32 ranks but --world is 64"),
    ("dp64.mb1.zz", "'zz' not understood"),
    ("dp8.dp8.mb1", "gives dp twice"),
])
def test_bad_layout_is_named(name, message, capsys) -> None:
    assert main(_plan("--layout", name)) == 2
    assert message in capsys.readouterr().err


def test_measured_json_carries_the_calibrated_prediction() -> None:
    """Bug (d): --json put the shipped profile's prediction beside this machine's measured step;
    the entry now carries the prediction the printed --measure table compares (the row's). The
    measurement itself runs in tests/plan/test_measure.py; here the row is built from two real
    predictions so that the two figures differ."""
    from hyperpar.plan import Layout, Run, example_spec, get_profile, plan
    from hyperpar.plan.measure import measured_entry
    from hyperpar.plan.memory import memory_per_rank
    from hyperpar.plan.report import to_json
    from hyperpar.plan.timing import step_time

    spec, run = example_spec("tiny"), Run(world=2, seq_len=16, global_batch=8,
                                          param_dtype="float32")
    result = plan(spec, run, get_profile("h100"))
    best = result.ranked[0]
    other = get_profile("a100")  # stands for the calibrated profile
    mem = memory_per_rank(spec, run, best.layout)
    calibrated = step_time(spec, run, best.layout, other, mem).step_ms
    row = {"peak_measured": 1000, "step_ms_measured": 12.5, "peak_predicted": mem.peak,
           "step_ms_predicted": calibrated}
    best.measured = measured_entry(row)
    doc = to_json(result)["layouts"][0]
    assert doc["measured"] == {"peak": 1000, "step_ms": 12.5, "predicted_peak": mem.peak,
                               "predicted_step_ms": calibrated}
    assert doc["predicted_step_ms"] != calibrated
    assert isinstance(best.layout, Layout)
