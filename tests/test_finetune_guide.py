"""docs/guides/finetune_your_own_vla.md, "A checkpoint without a tokenizer": its commands, run as the guide
writes them, on a tiny random PaliGemma saved by transformers with no tokenizer. Only what the guide tells
a user to change is changed: the checkpoint path (MODEL), where runs go (runs/ under a temporary
directory) and the quick-try flags of the guide's own QUICK_TRAIN / QUICK_EVAL block. Every process a
command starts is in its own session and is killed with it if it outlasts its time."""

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

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "finetune_your_own_vla.md"
TIMEOUT_S = 300


def block(marker: str) -> list[str]:
    """The lines of the bash block after the page's ``<!-- <marker>`` comment, comments and blanks left out."""
    return page_block(PAGE, marker)


def quick_flags() -> dict[str, list[str]]:
    """QUICK_TRAIN and QUICK_EVAL, as the guide assigns them."""
    return page_quick_flags(PAGE)


def commands(model: Path, runs: Path) -> list[list[str]]:
    """The no-tokenizer block's commands with $MODEL, runs/ and the interpreter as this machine has them,
    and the guide's quick-try flags appended."""
    quick = quick_flags()
    lines = block("no-tokenizer")
    assert lines[0].startswith("MODEL="), lines[0]
    out = []
    for line in lines[1:]:
        args = shlex.split(line.replace("$MODEL", str(model)), comments=True)
        args = [str(runs / a[len("runs/"):]) if a.startswith("runs/") else a for a in args]
        if args[0] == ".venv/bin/python":
            args[0] = sys.executable
        tool = args[1] if args[0] == sys.executable else args[0]
        out.append(args + quick["QUICK_TRAIN" if tool == "launch/run_local.sh" else "QUICK_EVAL"])
    return out


def run(args: list[str], env: dict) -> tuple[int, str]:
    """Run one command in its own session; past TIMEOUT_S, the whole session is stopped (SIGTERM, then
    SIGKILL) so that no learner, actor or server outlives the test."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                out, _ = proc.communicate(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{shlex.join(args)} ran over {TIMEOUT_S} s")
    finally:
        try:   # anything the command left behind in its session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.returncode, out


def test_the_guide_shows_whole_commands_for_a_checkpoint_without_a_tokenizer():
    lines = block("no-tokenizer")
    train = [line for line in lines if line.startswith("launch/run_local.sh")]
    assert train and all("--set env.cfg.instructions=ids --set env.cfg.instruction_length=4" in line for line in train)
    assert not any("env.cfg=" in line for line in lines)          # single keys, never the whole object
    assert any("--checkpoint none" in line and "--config" not in line for line in lines)   # the run's own config
    grpo = next(line for line in train if "grpo" in line)
    assert "algorithm.cfg.dynamic_sampling=true" in grpo and "actors.inference=server" in grpo
    assert set(quick_flags()) == {"QUICK_TRAIN", "QUICK_EVAL"}


@pytest.mark.slow
def test_the_guides_commands_run_on_a_checkpoint_without_a_tokenizer(tmp_path):
    from foreign_vla import save_foreign_checkpoint
    model = tmp_path / "my_paligemma"
    save_foreign_checkpoint(model, tokenizer=False)
    assert not (model / "tokenizer.json").exists()
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "TANDEM_PYTHON": sys.executable}
    for args in commands(model, tmp_path / "runs"):
        code, out = run(args, env)
        line = shlex.join(args)
        assert code == 0, f"{line}\n{out[-4000:]}"
        assert "Traceback" not in out, f"{line}\n{out[-4000:]}"
        if "launch/run_local.sh" in args:
            run_dir = Path(args[args.index("--out") + 1])
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["exit_code"] == 0 and summary["version"] >= 1 and summary["failed_updates"] == 0
            assert "instruction ids [4] are model token ids" in out
            fresh = [x for x in out.splitlines() if "starts fresh at zero" in x]
            if "vla_own_reach_ppo" in line:    # the value head: said once a run, by the learner
                assert len(fresh) == 1 and fresh[0].startswith("[learner]"), fresh
            else:                              # GRPO: no value head; dynamic sampling through the server
                cfg = json.loads((run_dir / "config.json").read_text())
                assert cfg["env"]["cfg"] == {"instructions": "ids", "instruction_length": 4, "reward": "success",
                                             "group_goals": "rotate"}
                assert cfg["algorithm"]["cfg"]["dynamic_sampling"] and cfg["actors"]["inference"] == "server"
                assert not fresh and "[inference 0] inference server 0 on cpu" in out
        else:
            assert re.search(r"\[evaluate\] \d+ episodes: return", out), out[-2000:]
