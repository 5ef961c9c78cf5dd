"""HipferryTrainer (hipferry.integrations.transformers): transformers.Trainer
with OffloadAdamW from ``optim_args`` alone, on a tiny Llama built from a
config. Against a plain Trainer with torch's AdamW: the same losses and the
same logged ``grad_norm`` while clipping fires, the clip done by
``OffloadAdamW.clip_grad_norm_`` (accelerate's never runs); LoRA (frozen
parameters left out) with gradient accumulation and overlap=backward; save
and resume (optimizer.pt) with host float32, host 8-bit and disk state giving
the uninterrupted run; bad options refused before anything is built."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from conftest import requires_gpu  # noqa: E402
from hf_trainer_helpers import (assert_close_lists, dataset, logged, tiny_llama, train, trainable_state,  # noqa: E402
                                training_args, with_lora)

from hipferry.integrations.transformers import HipferryTrainer  # noqa: E402
from hipferry.optim import OffloadAdamW  # noqa: E402


@pytest.fixture
def clip_calls(monkeypatch):
    """Counts the calls of OffloadAdamW.clip_grad_norm_ ("hipferry") and of
    Accelerator.clip_grad_norm_ ("accelerate", which reads the gradients again)."""
    import accelerate
    calls = {"hipferry": [], "accelerate": []}

    def counting(cls, key):
        real = getattr(cls, "clip_grad_norm_")

        def count(self, *args, **kwargs):
            calls[key].append(args)
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, "clip_grad_norm_", count)
    counting(OffloadAdamW, "hipferry")
    counting(accelerate.Accelerator, "accelerate")
    return calls


def reference(tmp_path, model, **overrides):
    return train(transformers.Trainer, model, training_args(str(tmp_path / "ref"), optim="adamw_torch", **overrides))


@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0], ids=["clipping", "norm-only"])
def test_losses_and_grad_norm_equal_torch_adamw(tmp_path, clip_calls, max_grad_norm):
    ref = reference(tmp_path, tiny_llama(), max_grad_norm=max_grad_norm)
    assert len(clip_calls["accelerate"]) == 4  # the reference's: one a step
    clip_calls["accelerate"].clear()
    ours = train(HipferryTrainer, tiny_llama(), training_args(str(tmp_path / "ours"), max_grad_norm=max_grad_norm))
    assert isinstance(ours.hipferry_optimizer(), OffloadAdamW)
    assert not clip_calls["accelerate"], "Accelerator.clip_grad_norm_ read the gradients again"
    assert [c[0] for c in clip_calls["hipferry"]] == [max_grad_norm or float("inf")] * 4
    norms = logged(ours, "grad_norm")
    if max_grad_norm:
        assert min(norms) > 10 * max_grad_norm, "clipping should fire in every step of this test"
    assert_close_lists(norms, logged(ref, "grad_norm"), "grad_norm")
    assert_close_lists(logged(ours, "loss"), logged(ref, "loss"), "loss")


@requires_gpu
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_on_a_gpu_the_clip_scales_the_host_copies(tmp_path, clip_calls, overlap):
    """A GPU model: parameters of 1024+ elements have host state (min_offload_numel), their
    gradients are copied to the host in backward and the clip scales those copies; losses and
    grad norms equal torch's AdamW on the GPU (GPU tolerances: reduction orders differ)."""
    ref = reference(tmp_path, tiny_llama(), use_cpu=False)
    optim_args = f"min_offload_numel=1024,overlap={overlap}"
    ours = train(HipferryTrainer, tiny_llama(), training_args(str(tmp_path / "ours"), use_cpu=False,
                                                              optim_args=optim_args))
    opt = ours.hipferry_optimizer()
    stats = opt.memory_stats()
    assert opt.step_on == "cpu" and stats["host_state_bytes"] > 0 and stats["grad_buffer_bytes"] > 0, stats
    assert next(ours.model.parameters()).is_cuda
    assert len(clip_calls["hipferry"]) == 4 and len(clip_calls["accelerate"]) == 4  # the reference's 4
    assert_close_lists(logged(ours, "grad_norm"), logged(ref, "grad_norm"), "grad_norm", rtol=1e-3, atol=1e-4)
    assert_close_lists(logged(ours, "loss"), logged(ref, "loss"), "loss", rtol=1e-3, atol=1e-4)


def test_lora_with_accumulation_and_overlap(tmp_path, clip_calls):
    """LoRA: only the adapters reach the optimizer. Accumulation over 2 micro-batches with
    overlap=backward: the first runs under opt.accumulating(), the steps equal torch's.
    activations=hipferry: the saved tensors went through offload_activations."""
    common = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)
    ref = reference(tmp_path, with_lora(tiny_llama()), **common)
    model = with_lora(tiny_llama())
    optim_args = "overlap=backward,activations=hipferry,activations_min_bytes=1KiB"
    ours = train(HipferryTrainer, model, training_args(str(tmp_path / "ours"), optim_args=optim_args, **common))
    opt = ours.hipferry_optimizer()
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert in_opt == trainable and len(trainable) < len(list(model.parameters()))
    stats = opt.overlap_stats()
    assert stats["overlap"] == "backward" and stats["started"] > 0, stats
    assert len(clip_calls["accelerate"]) == 4  # the reference's only
    activations = ours.hipferry_activations.stats()
    assert activations["offloaded_tensors"] > 0 and activations["prefetch_hits"] > 0, activations
    assert_close_lists(logged(ours, "grad_norm"), logged(ref, "grad_norm"), "grad_norm")
    assert_close_lists(logged(ours, "loss"), logged(ref, "loss"), "loss")


@pytest.mark.parametrize("state", ["host", "host8", "disk"])
def test_resume_continues_as_uninterrupted(tmp_path, state):
    """4 steps with a checkpoint at step 2, then a new trainer resumes from it: the losses
    of steps 3-4 and the final weights equal the uninterrupted run's. Disk: the same
    state_dir, which holds step 4's state when the resume reopens it."""
    optim_args = f"state={state}" + (f",state_dir={tmp_path / 'state'}" if state == "disk" else "")
    args = dict(optim_args=optim_args, save_strategy="steps", save_steps=2)
    model = with_lora(tiny_llama())
    full = train(HipferryTrainer, model, training_args(str(tmp_path / "out"), **args))
    expected, expected_loss = trainable_state(model), logged(full, "loss")[2:]
    del full
    import gc
    gc.collect()  # (disk: the first optimizer's lock on the folder goes with it)
    resumed_model = with_lora(tiny_llama())
    with torch.no_grad():  # other adapter weights: the checkpoint must set them (it holds the adapters only)
        for p in resumed_model.parameters():
            if p.requires_grad:
                p.normal_()
    resumed = train(HipferryTrainer, resumed_model, training_args(str(tmp_path / "out"), **args),
                    resume=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    if state == "disk":  # the folder held step 4 and was reopened; the state is in its files
        assert resumed._hipferry_reopened and resumed.hipferry_optimizer().memory_stats()["disk_state_bytes"] > 0
    assert_close_lists(logged(resumed, "loss")[2:], expected_loss, "loss after resume")  # [:2]: from the checkpoint
    got = trainable_state(resumed_model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=lambda m: f"{name}: {m}")


def test_an_offload_adamw_passed_in_also_clips_on_the_host(tmp_path, clip_calls):
    """optimizers=(OffloadAdamW(...), None): Trainer's precedence (the options build nothing),
    and the clip still goes through it."""
    model = tiny_llama()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ours = train(HipferryTrainer, model, training_args(str(tmp_path)), optimizers=(opt, None))
    assert ours.hipferry_optimizer() is opt and opt.state
    assert len(clip_calls["hipferry"]) == 4 and not clip_calls["accelerate"]


def test_import_hipferry_needs_no_trainer_framework():
    import subprocess
    import sys
    code = ("import sys, hipferry, hipferry.integrations, hipferry.integrations.options; "
            "print(sorted(m for m in ('transformers', 'trl', 'axolotl', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_arguments_stay_json_serializable(tmp_path):
    args = training_args(str(tmp_path), optim_args="state=host8,overlap=backward")
    assert json.loads(args.to_json_string())["optim_args"] == "state=host8,overlap=backward"


@pytest.mark.parametrize("optim_args,optim,match", [
    ("state=gpu", None, r"option 'state' must be one of 'host', 'host8', 'disk', 'disk8', got 'gpu'"),
    ("sate=host8", None, r"unknown option 'sate'; expected one of state, state_dir"),
    ("state=disk", None, r"state=disk needs the option 'state_dir'"),
    ("overlap=forward", None, r"option 'overlap' must be one of 'none', 'backward'"),
    ("disk_window=lots", None, r"option 'disk_window' must be a byte count"),
    ("state", None, r"'state' is not key=value"),
    ("min_offload_numel=-1", None, r"option 'min_offload_numel' must be an int >= 0, got '-1'"),
    ("", "sgd", r"TrainingArguments.optim must be one of adamw_torch, adamw_torch_fused"),
])
def test_bad_options_are_refused_before_anything_is_built(tmp_path, monkeypatch, optim_args, optim, match):
    built = []
    monkeypatch.setattr(OffloadAdamW, "__init__", lambda *a, **k: built.append("optimizer"))
    monkeypatch.setattr(transformers.Trainer, "__init__", lambda *a, **k: built.append("trainer"))
    extra = {"optim": optim} if optim else {}
    args = training_args(str(tmp_path), optim_args=optim_args, **extra)
    with pytest.raises(ValueError, match=match):
        HipferryTrainer(model=tiny_llama(), args=args, train_dataset=dataset())
    assert not built
