"""The docs are a client: every ```python block in README.md and docs/*.md runs as written.

Each block runs on the ranks its launch line shows (a comment in its first lines such as
``# hyperpar run -n 4 example.py`` or ``torchrun --nproc-per-node 2``; none: one process), as a
script, in a scratch folder shared by the blocks of its page (in page order: a later block may
read what an earlier one saved), with the repository on ``PYTHONPATH``. A block may get a
prelude defining only the model (or data) it names (``PRELUDES``). Blocks that are deliberately
not runnable are listed in ``NOT_RUNNABLE`` with the reason, or recognised by rule: ``>>>``
sessions, and "before:" blocks showing another library's code. New pages and blocks are picked
up automatically.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpar.testing.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
LAUNCH = re.compile(r"(?:hyperpar run\s+-n|--nproc[-_]per[-_]node)[ =]?(\d+)")
TIMEOUT_S = 420

_MODEL_LAYERS = '''
import torch
from torch import nn


class _MLP(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        setattr(self, a, nn.Linear(16, 32))
        setattr(self, b, nn.Linear(32, 16))
        self.names = (a, b)

    def forward(self, x):
        return getattr(self, self.names[1])(torch.relu(getattr(self, self.names[0])(x)))


class _Layer(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.mlp = _MLP(a, b)

    def forward(self, x):
        return x + self.mlp(x)


class _Model(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(a, b) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


model = _Model({a!r}, {b!r})
'''

_LLAMA = '''
import sys

sys.path.insert(0, {root!r})
from examples.llama import model as _llama

cfg = _llama.ModelArgs.tiny()
Transformer = _llama.Transformer
model = _llama.build(cfg, seed=0)
tokens, labels = _llama.batch(cfg, seed=1)
'''

_DP_TP = _LLAMA + '''
import torch.nn.functional as F
from examples.llama.plan import tp_plan

plan = tp_plan()
loader = [_llama.batch(cfg, seed=i) for i in range(2)]


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
'''

_INSPECT = _DP_TP + '''
from hyperpar import init_device_mesh, parallelize_module

mesh = init_device_mesh((1, 2), mesh_dim_names=("dp", "tp"))
parallelize_module(model, mesh["tp"], plan)
B, S = tokens.shape
'''

_PIPE = '''
import torch
from torch import nn
from hyperpar.pipeline import LayerSpec, TiedLayerSpec

vocab, dim, n_layers = 32, 16, 4
Embedding = nn.Embedding


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def lm_head(embedding, h):
    return h @ embedding.weight.t()


def cross_entropy(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


layers = [
    TiedLayerSpec("embed", Embedding, vocab, dim),
    *[LayerSpec(Block, dim) for _ in range(n_layers)],
    TiedLayerSpec("embed", Embedding, vocab, dim, forward_fn=lm_head,
                  tied_weight_attr="weight"),
]
g = torch.Generator().manual_seed(0)
batches = [(torch.randint(vocab, (8, 6), generator=g),) * 2 for _ in range(2)]
'''

#: (page, a line of the block) -> code run before the block (the model it names, no more)
PRELUDES: dict[tuple[str, str], str] = {
    ("README.md", '"layers.*.mlp.w1"'): _MODEL_LAYERS.format(a="w1", b="w2"),
    ("docs/index.md", '"layers.*.mlp.up"'): _MODEL_LAYERS.format(a="up", b="down"),
    ("docs/tensor-parallel.md", '"tok_embeddings"'): _LLAMA.format(root=str(ROOT)),
    ("docs/tensor-parallel.md", "tp_sp_plan(loss_parallel=True)"): _LLAMA.format(root=str(ROOT)),
    ("docs/migration.md", "# after: hyperpar, any backend"): _LLAMA.format(root=str(ROOT)),
    ("docs/migration.md", "# after: hyperpar -- the layer list is the same"): _PIPE,
    ("docs/data-parallel.md", "data_parallel(model, mesh, \"dp\")"): _DP_TP.format(root=str(ROOT)),
    ("docs/inspect.md", "InspectedModel(model, mesh=mesh"): _INSPECT.format(root=str(ROOT)),
}

#: (page, a line of the block) -> why the block is not run
NOT_RUNNABLE: dict[tuple[str, str], str] = {
    ("docs/mindspore.md", "mp_policy=MixedPrecisionPolicy("):
        "a MindSpore fragment (this venv has torch, not MindSpore): tests/mindspore/"
        "test_fully_shard.py trains fully_shard Cells with the same policy on real ranks",
    ("docs/data-parallel.md", "data_parallel(pipe, mesh"):
        "a fragment indented inside a list item, showing three calls in context",
    ("docs/mindspore.md", "import mindspore as ms"):
        "MindSpore code (this venv has torch, not MindSpore): the same steps run as "
        "examples/mindspore_tp_mlp.py under scripts/test-mindspore.sh",
    ("docs/mindspore.md", "@ms.jit"):
        "a MindSpore fragment (this venv has torch, not MindSpore): tests/mindspore/"
        "test_graph_mode.py runs the same jitted step on real ranks",
    ("docs/mindspore.md", "from hyperpar.pipeline import LayerSpec, PipelineModule, TiedLayerSpec"):
        "MindSpore code (this venv has torch, not MindSpore): tests/mindspore/test_pipeline.py "
        "and tests/both/test_pipeline.py train the same API on real ranks",
    ("docs/mindspore.md", "# HYPERPAR_BACKEND=mindspore hyperpar run -n 4 pipe_dp.py"):
        "a MindSpore fragment (this venv has torch, not MindSpore): tests/mindspore/"
        "test_pipeline.py trains pp x dp and pp x fully_shard the same way on 4 real ranks",
    ("docs/mindspore.md", "# HYPERPAR_BACKEND=mindspore hyperpar run -n 4 ep_fsdp.py"):
        "a MindSpore fragment (this venv has torch, not MindSpore; ``model`` is the reader's): "
        "tests/both/test_moe.py trains EP x fully_shard this way on 2 and 4 real ranks",
    ("docs/mindspore.md", "# HYPERPAR_BACKEND=mindspore hyperpar run -n 4 dtensor_demo.py"):
        "MindSpore code (this venv has torch, not MindSpore): tests/mindspore/test_dtensor.py "
        "runs the same calls on real ranks",
    ("docs/mindspore.md", "def _heads(self, t):"):
        "a MindSpore fragment (this venv has torch, not MindSpore): tests/mindspore/"
        "test_fully_shard.py trains the same block and plan (dp2 x tp2) on real ranks",
    ("docs/mindspore.md", "step = ms.jit(step_fn)"):
        "a MindSpore fragment (this venv has torch, not MindSpore): tests/mindspore/"
        "test_graph_mode.py compiles the same fully_shard step on real ranks",
}


def _find(table: dict[tuple[str, str], str], page: str, code: str) -> str | None:
    return next((v for (p, line), v in table.items() if p == page and line in code), None)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for path in PAGES:
        text = path.read_text()
        page = str(path.relative_to(ROOT))
        for m in FENCE.finditer(text):
            found.append((page, text.count("\n", 0, m.start()) + 2, m.group(1)))
    return found


def not_runnable_reason(page: str, code: str) -> str | None:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if first.startswith(">>>"):
        return "an interactive session (>>> prompts), not a script"
    if re.match(r"#\s*before\b", first):
        return "the code before migrating (another library or device); the 'after' block runs"
    return _find(NOT_RUNNABLE, page, code)


def ranks_of(code: str) -> int:
    for line in code.splitlines()[:3]:
        m = LAUNCH.search(line) if line.lstrip().startswith("#") else None
        if m:
            return int(m.group(1))
    return 1


def run_block(code: str, ranks: int, cwd: Path, name: str) -> list[subprocess.CompletedProcess]:
    """Run ``code`` as a script on ``ranks`` processes joined the way a launcher joins them."""
    script = cwd / f"{name}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("HYPERPAR_BACKEND", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    procs = []
    for r in range(ranks):
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r)) if ranks > 1 else env
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return results


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {page: tmp_path_factory.mktemp(page.replace("/", "_").replace(".md", ""))
            for page in {b[0] for b in BLOCKS}}


@pytest.mark.parametrize(("page", "line", "code"), BLOCKS,
                         ids=[f"{p}:{line}" for p, line, _ in BLOCKS])
def test_doc_block_runs_as_written(page: str, line: int, code: str,
                                   page_dirs: dict[str, Path]) -> None:
    reason = not_runnable_reason(page, code)
    if reason:
        pytest.skip(f"not runnable by design: {reason}")
    prelude = _find(PRELUDES, page, code) or ""
    ranks = ranks_of(code)
    # the prelude goes after a leading launch comment but before everything else
    results = run_block(prelude + "\n" + code, ranks, page_dirs[page], f"block_{line}")
    bad = [(r, res) for r, res in enumerate(results) if res.returncode != 0]
    if bad:
        rank, res = bad[0]
        pytest.fail(f"{page}:{line} on {ranks} rank(s): rank {rank} exited {res.returncode}\n"
                    f"{res.stdout[-3000:]}")


def test_readme_single_process_command_runs_without_a_launcher(tmp_path: Path) -> None:
    """README lists `python examples/tp_mlp.py`: with no launcher it is a world of one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("HYPERPAR_BACKEND", "cpu")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_mlp.py"), "--steps", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_page_is_scanned_and_launch_lines_are_read() -> None:
    assert any(p == "README.md" for p, _, _ in BLOCKS)
    assert ranks_of("# hyperpar run -n 4 example.py\nx = 1") == 4
    assert ranks_of("# HYPERPAR_BACKEND=cpu torchrun --nproc-per-node 2 t.py\n") == 2
    assert ranks_of("import torch\n") == 1
