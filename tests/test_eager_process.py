"""A process that never compiles runs torch's dynamo-disabled functions without importing
torch._dynamo (scalelab/eager_process.py), and gets torch's own wrappers back the moment
anything imports it. Each case runs in a fresh interpreter: the pytest process has imported
dynamo long before."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

META_OPS = """
import torch
x = torch.empty(4, 8, device="meta")
w = torch.empty(3, 8, device="meta")
y = torch.nn.functional.linear(x, w).relu().round()  # Python meta kernels, dynamo-disabled
assert y.shape == (4, 3)
"""


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_meta_kernels_and_an_optimizer_leave_dynamo_unimported():
    got = _run(
        "import json, sys\nfrom scalelab import eager_process\neager_process.stay_eager()\n"
        + META_OPS
        + "m = torch.nn.Linear(8, 3)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "opt.zero_grad()\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules,"
        " 'seeded': eager_process.seeded()}))"
    )
    assert got["dynamo"] is False and got["seeded"] > 100, got


def test_without_the_seed_the_same_ops_import_dynamo():
    """The reference: torch itself imports dynamo for them (else the test above says nothing)."""
    got = _run(
        "import json, sys\n" + META_OPS + "print(json.dumps('torch._dynamo' in sys.modules))"
    )
    assert got is True


def test_importing_dynamo_restores_torchs_wrappers_and_compile_works():
    got = _run(
        "import json, sys\nfrom scalelab import eager_process\neager_process.stay_eager()\n"
        + META_OPS
        + "before = eager_process.seeded()\n"
        "import torch._compile, torch._dynamo\n"
        "fn = torch.optim.Optimizer.zero_grad.__wrapped__\n"
        "m = torch.nn.Linear(8, 3)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "opt.zero_grad()  # cached again, now as dynamo's own disable of the function\n"
        "cached = getattr(fn, '__dynamo_disable', None)\n"
        "f = torch.compile(lambda t: (t * 2).sin(), backend='eager')\n"
        "t = torch.arange(4.0)\n"
        "print(json.dumps({'before': before, 'after': eager_process.seeded(),"
        " 'real_wrapper': cached is not None and cached is not fn,"
        " 'decorator': {torch._disable_dynamo.__module__,"
        " torch._compile._disable_dynamo.__module__} == {'torch._compile'},"
        " 'compiled_ok': bool(torch.equal(f(t), (t * 2).sin()))}))"
    )
    assert got["before"] > 100 and got["after"] == 0, got
    assert got["real_wrapper"] and got["decorator"] and got["compiled_ok"], got


def test_a_user_models_inference_run_imports_no_dynamo(tmp_path):
    """The CLI seeds first thing: a user's token model probed on meta and run, no compile."""
    got = _run(
        "import json, sys\nfrom scalelab.cli.main import main\n"
        "code = main(['run', 'model', '--model', 'examples/models/tokcnn.py:tokcnn',"
        " '--input-shape', '64', '--input-dtype', 'int64', '--vocab', '100', '--batch', '4',"
        " '--iters', '2', '--warmup', '0', '--no-record', '-q'])\n"
        "print(json.dumps({'code': code, 'dynamo': 'torch._dynamo' in sys.modules}))"
    )
    assert got == {"code": 0, "dynamo": False}


# Two SGD optimizers with momentum on the same weights and gradients: torch's own step (the
# reference) and eager_step's, three steps each under an LR scheduler, with a post-step hook.
TWO_STEPPERS = """
import json, sys, copy, torch
from scalelab import eager_process
torch.manual_seed(0)
ref = torch.nn.Linear(8, 3)
mine = copy.deepcopy(ref)
x, y = torch.randn(16, 8), torch.randn(16, 3)
hooked = []
def make(model, eager):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = eager_process.eager_step(opt) if eager else opt
    opt.register_step_post_hook(lambda o, a, k: hooked.append(eager))
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
def train(model, opt, sched):
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
"""


def test_an_eager_step_is_torchs_step_without_importing_dynamo():
    """The same update, hooks and schedule as torch's step (weights bitwise), no dynamo."""
    got = _run(
        TWO_STEPPERS + "eager_process.stay_eager()\n"
        "mine_opt = make(mine, True)\ntrain(mine, *mine_opt)\n"
        "dynamo = 'torch._dynamo' in sys.modules\n"
        "train(ref, *make(ref, False))\n"
        "same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters()))\n"
        "print(json.dumps({'dynamo_after_eager': dynamo, 'same': same, 'hooked': hooked,"
        " 'own_step': 'step' in vars(mine_opt[0]),"
        " 'dynamo_after_torch': 'torch._dynamo' in sys.modules}))"
    )
    assert got["own_step"] and got["dynamo_after_eager"] is False, got
    assert got["dynamo_after_torch"] is True  # torch's own step does import it (the reference)
    assert got["same"] and got["hooked"] == [True] * 3 + [False] * 3, got


def test_once_dynamo_is_loaded_an_eager_step_is_torchs_own():
    """A compile anywhere in the process: the step goes through torch's wrapper again."""
    got = _run(
        TWO_STEPPERS + "import torch._dynamo\n"
        "seen = []\n"
        "orig = torch._dynamo.graph_break\n"
        "torch._dynamo.graph_break = lambda: seen.append(1) or orig()\n"
        "train(mine, *make(mine, True))\ntrain(ref, *make(ref, False))\n"
        "same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters()))\n"
        "print(json.dumps({'breaks': len(seen), 'same': same}))"
    )
    assert got == {"breaks": 12, "same": True}, got  # 2 per step, 6 steps
