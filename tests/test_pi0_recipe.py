"""docs/guides/finetune_pi0.md, "The three commands" and the evaluation after them, run as the page writes them
with the page's own quick-try flags appended. The first command writes a tiny π0 with ``save_pretrained``
(launch/pretrain_pi0_reach.py, a few gradient steps); the PPO and GRPO runs fine-tune it through
``launch/run_local.sh``; ``launch/evaluate.py`` measures the PPO run's starting point and best version. Only
what the page tells a user to change is changed: where the checkpoint and the runs go (under a temporary
directory) and the interpreter. Every command runs in its own session, which is killed when it ends or outlasts
its time, so no learner or actor outlives the test."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from children import child_pythonpath
from guide_pages import page_block, page_quick_flags

pytest.importorskip("transformers.models.pi0")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "finetune_pi0.md"
TIMEOUT_S = 240


def block(marker: str) -> list[str]:
    """The lines of the bash block after the page's ``<!-- <marker>`` comment, comments and blanks left out."""
    return page_block(PAGE, marker)


def quick_flags() -> dict[str, list[str]]:
    """QUICK_PRETRAIN and QUICK_TRAIN, as the page assigns them."""
    return page_quick_flags(PAGE)


def commands(marker: str, model: Path, runs: Path) -> list[list[str]]:
    """A block's commands with $MODEL, runs/ and the interpreter as this machine has them, and the page's
    quick-try flags appended."""
    quick = quick_flags()
    flags = {"launch/run_local.sh": "QUICK_TRAIN", "launch/pretrain_pi0_reach.py": "QUICK_PRETRAIN",
             "launch/evaluate.py": "QUICK_EVAL"}
    out = []
    for line in block(marker):
        args = shlex.split(line.replace("$MODEL", str(model)), comments=True)
        args = [str(runs / a[len("runs/"):]) if a.startswith("runs/") else a for a in args]
        if args[0] == ".venv/bin/python":
            args[0] = sys.executable
        tool = args[1] if args[0] == sys.executable else args[0]
        out.append(args + quick[flags[tool]])
    return out


def run(args: list[str], env: dict) -> tuple[int, str]:
    """Run one command in its own session. Past TIMEOUT_S the session is stopped (SIGTERM, then SIGKILL), and
    whatever the command left running in it is killed in any case."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.communicate(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{shlex.join(args)} ran over {TIMEOUT_S} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.returncode, out


def test_the_page_shows_three_commands_and_its_quick_flags():
    lines = block("recipe")
    assert [shlex.split(line)[:2] for line in lines] == [
        [".venv/bin/python", "launch/pretrain_pi0_reach.py"], ["launch/run_local.sh", "--config"],
        ["launch/run_local.sh", "--config"]]
    assert "configs/pi0_reach_ppo.json" in lines[1] and "configs/pi0_reach_grpo.json" in lines[2]
    assert set(quick_flags()) == {"QUICK_PRETRAIN", "QUICK_TRAIN", "QUICK_EVAL"}
    assert [shlex.split(line)[1:5] for line in block("evaluate")] == [
        ["launch/evaluate.py", "runs/pi0_ppo", "--checkpoint", "none"],
        ["launch/evaluate.py", "runs/pi0_ppo", "--checkpoint", "best"]]


@pytest.mark.slow
def test_the_recipes_commands_run(tmp_path):
    model = tmp_path / "pi0_reach"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "TANDEM_PYTHON": sys.executable}
    pretrain, ppo, grpo = commands("recipe", model, tmp_path / "runs")
    code, out = run(pretrain, env)
    assert code == 0 and "Traceback" not in out, out[-4000:]
    assert {"config.json", "model.safetensors", "pretrain.json"} <= {p.name for p in model.iterdir()}
    assert "[pretrain] saved" in out
    for args, method in ((ppo, "Flow-Noise"), (grpo, "Flow-SDE")):
        code, out = run(args, env)
        line = shlex.join(args)
        assert code == 0 and "Traceback" not in out, f"{line}\n{out[-4000:]}"
        run_dir = Path(args[args.index("--out") + 1])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["exit_code"] == 0 and summary["version"] >= 1 and summary["failed_updates"] == 0, summary
        assert f"[learner] flow_vla: π0 from {model}, {method}, K = 4 steps, chunks of 8 actions" in out, out[-4000:]
    for args in commands("evaluate", model, tmp_path / "runs"):    # the cloned model, then the best version
        code, out = run(args, env)
        assert code == 0 and "Traceback" not in out, f"{shlex.join(args)}\n{out[-4000:]}"
        assert re.search(r"\[evaluate\] 8 episodes: return .* \| success", out), out[-2000:]
