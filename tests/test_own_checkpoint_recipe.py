"""docs/guides/finetune_your_own_vla.md: its three commands, run as written (shortened with appended
flags), on a checkpoint saved by transformers in the test: PPO with a fresh value head and GRPO train
through launch/run_local.sh, the evaluation reads the PPO run, and the instruction ids the learner
received over the wire are the checkpoint tokenizer's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from children import child_pythonpath
from foreign_vla import make_tokenizer, save_foreign_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "finetune_your_own_vla.md"
# Appended to each command: the same run, shorter (argparse and --set take the last value given), with
# one actor (each VLA process start-up loads transformers and the model; two actors act as one here).
SHORT = {"launch/run_local.sh": ["--steps", "512", "--actors", "1", "--set", "trainer.eval_freq=256", "--set",
                                 "trainer.num_eval_episodes=8", "--set", "actors.num_envs=8", "--set",
                                 "trainer.buffer_size=16"],
         "launch/evaluate.py": ["--episodes", "16", "--batch", "16"]}


def recipe() -> list[str]:
    """The lines of the bash block after the page's ``<!-- recipe`` marker."""
    text = PAGE.read_text()
    block = re.search(r"<!-- recipe.*?-->\s*```bash\n(.*?)```", text, re.S)
    assert block, f"{PAGE}: no recipe block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_recipe_is_three_commands_that_the_readme_links_to():
    assert len(recipe()) == 3
    assert "docs/guides/finetune_your_own_vla.md" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_the_recipe_runs_on_a_save_pretrained_checkpoint(tmp_path):
    model = tmp_path / "my_paligemma"
    save_foreign_checkpoint(model)
    env = {**os.environ, "MODEL": str(model), "PYTHONPATH": child_pythonpath(), "TANDEM_PYTHON": sys.executable}
    for i, line in enumerate(recipe()):
        args = shlex.split(os.path.expandvars(line.replace("$MODEL", str(model))))
        args = [str(tmp_path / a) if a.startswith("runs/") else a for a in args]     # runs go to tmp_path
        if args[0] == ".venv/bin/python":
            args[0] = sys.executable
        tool = next(k for k in SHORT if k in args[:2])
        extra = SHORT[tool] + (["--record"] if i == 0 else [])
        if "vla_own_reach_grpo" in line:     # 8 envs x 16 steps: two groups of 4, one minibatch
            # and no evaluator: nothing reads the GRPO run's evaluations (the PPO run's best checkpoint is
            # the one the third command evaluates)
            extra += ["--set", "algorithm.cfg.batch_size=128", "--no-eval"]
        p = subprocess.run(args + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                           start_new_session=True)
        assert p.returncode == 0, f"{line}\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        if tool == "launch/run_local.sh":
            out = Path(args[args.index("--out") + 1])
            summary = json.loads((out / "summary.json").read_text())
            assert summary["exit_code"] == 0 and summary["env_steps"] >= 512 and summary["version"] >= 2
            assert summary["malformed"] == 0 and summary["failed_updates"] == 0
            assert "VLA: transformers.PaliGemmaForConditionalGeneration from" in p.stdout
            assert ("starts fresh at zero" in p.stdout + p.stderr) == ("ppo" in line)   # PPO's value head only
        else:
            assert "episodes: return" in p.stdout + p.stderr
    # what crossed the wire: every instruction row of every trained batch is a tokenized Reach instruction
    from tensordict import TensorDict
    hf = make_tokenizer()
    rows = {tuple(hf(f"reach {c}", add_special_tokens=False).input_ids + [hf.pad_token_id] * 6)
            for c in ("red", "green", "blue")}
    record = tmp_path / "runs" / "own_ppo" / "record"
    entries = [json.loads(x) for x in (record / "index.jsonl").read_text().splitlines() if x.strip()]
    assert entries
    for entry in entries:
        batch = TensorDict.load_memmap(record / entry["dir"])
        instr = batch["observation", "instruction"].reshape(-1, 8)
        assert instr.dtype == torch.int64 and {tuple(r) for r in instr.tolist()} <= rows
        assert len({tuple(r) for r in instr.tolist()}) > 1
