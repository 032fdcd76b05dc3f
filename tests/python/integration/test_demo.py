"""The README's main job (tensor-parallel decoding) and the DDP example, run
as a user runs them, plus the demo's own check on a corrupted run."""

import subprocess
import sys

import pytest
import torch


def _run(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, out.stdout, out.stderr


@pytest.mark.parametrize("tp,steps", [(1, 6), (2, 12), (3, 7)])
def test_tensor_parallel_demo_passes_its_check(tp, steps):
    rc, out, err = _run("tpcomm.demo", "--tp", str(tp), "--steps", str(steps), "--device", "cpu")
    assert rc == 0, out + err
    assert f"TP={tp} on CPU" in out and "tokens/s" in out and out.rstrip().endswith("OK")
    # 2 allreduces per layer + the embedding's, and the LM head's all-gather, per step
    calls = steps * (2 * 4 + 1 + 1)
    if tp > 1:
        assert f"cpu_shm {calls} calls" in out, out
        assert f"message-queue broadcasts of step inputs: {steps}" in out
    want = max(0, steps - 4) * 8
    assert f"generated tokens equal to its argmax: {want}/{want}" in out, out


def test_demo_refuses_a_tp_size_that_does_not_divide_the_model():
    rc, out, err = _run("tpcomm.demo", "--tp", "5", "--device", "cpu")
    assert rc == 2 and "--tp 5 does not divide the model's heads (12)" in err, err


def test_demo_check_fails_on_a_wrong_run():
    from tpcomm.demo.tp_model import Config, check, reference_logits

    cfg = Config(layers=1, vocab=96, hidden=48, heads=4, ffn=96, batch=3)
    steps = 7
    inputs = torch.zeros(steps, cfg.batch, dtype=torch.int64)
    inputs[:cfg.prompt] = torch.arange(cfg.prompt * cfg.batch).reshape(cfg.prompt, cfg.batch)
    # Greedy decoding with the reference itself gives a passing run ...
    for s in range(cfg.prompt, steps):
        inputs[s] = reference_logits(cfg, inputs[:s])[-1].argmax(-1)
    logits = reference_logits(cfg, inputs).float()
    ok, diff, exact, total, _ = check(cfg, inputs, logits)
    assert ok and exact == total == (steps - cfg.prompt) * cfg.batch and diff < 1e-5
    # ... a perturbed logit fails it ...
    bad = logits.clone()
    bad[2, 1, 5] += 0.1
    ok, diff, _, _, why = check(cfg, inputs, bad)
    assert not ok and "max |logit diff|" in why and diff > 0.09
    # ... and so does a generated token that is not the argmax.
    wrong = inputs.clone()
    ref = reference_logits(cfg, inputs)
    wrong[steps - 1, 0] = ref[steps - 2, 0].argmin()
    ok, _, exact, _, why = check(cfg, wrong, reference_logits(cfg, wrong).float())
    assert not ok and "off the reference argmax: 1" in why


def test_ddp_example_trains():
    rc, out, err = _run("tpcomm.demo.ddp", "--nproc", "2", "--steps", "20")
    assert rc == 0, out + err
    assert "replicas identical: True" in out and out.rstrip().endswith("OK")
