"""HipferrySFTTrainer (hipferry.integrations.trl): TRL's SFTTrainer with
OffloadAdamW and, with ``activations=hipferry``, hipferry.offload_activations
in place of TRL's context, from ``SFTConfig.optim_args`` alone. Its losses and
grad norms equal SFTTrainer's with torch's AdamW and no offloading; the
activations really went through hipferry's pool; bad options are refused
before anything is built."""
import pytest

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from hf_trainer_helpers import (assert_close_lists, logged, sft_config, tiny_llama, tiny_tokenizer,  # noqa: E402
                                tokenized_dataset, train)

from hipferry.integrations.trl import HipferrySFTTrainer  # noqa: E402
from hipferry.optim import OffloadAdamW  # noqa: E402


def sft(cls, config):
    return train(cls, tiny_llama(), config, train_dataset=tokenized_dataset(), processing_class=tiny_tokenizer())


@pytest.mark.parametrize("optim_args", ["activations=hipferry,activations_min_bytes=1KiB",
                                        "state=host8,activations=none"])
def test_sft_losses_equal_trl_without_offloading(tmp_path, optim_args):
    ref = sft(trl.SFTTrainer, sft_config(str(tmp_path / "ref"), optim="adamw_torch"))
    ours = sft(HipferrySFTTrainer, sft_config(str(tmp_path / "ours"), optim_args=optim_args))
    assert isinstance(ours.hipferry_optimizer(), OffloadAdamW)
    if "host8" in optim_args:
        # 8-bit moments: the first step is exact (no state read yet), later ones are close
        assert_close_lists(logged(ours, "loss")[:2], logged(ref, "loss")[:2], "loss", rtol=1e-5)
        assert_close_lists(logged(ours, "loss"), logged(ref, "loss"), "loss", rtol=1e-2)
        assert ours.hipferry_activations is None
        return
    assert_close_lists(logged(ours, "loss"), logged(ref, "loss"), "loss", rtol=1e-4)
    assert_close_lists(logged(ours, "grad_norm"), logged(ref, "grad_norm"), "grad_norm", rtol=1e-3)
    assert ours.maybe_activation_offload_context is ours.hipferry_activations
    stats = ours.hipferry_activations.stats()
    assert stats["offloaded_tensors"] > 0 and stats["prefetch_misses"] + stats["prefetch_hits"] > 0, stats


@pytest.mark.parametrize("optim_args,match", [
    ("activations=trl", r"option 'activations' must be one of 'none', 'hipferry', got 'trl'"),
    ("activations_min_bytes=-3", r"option 'activations_min_bytes' must be a byte count"),
])
def test_bad_sft_options_are_refused(tmp_path, monkeypatch, optim_args, match):
    built = []
    monkeypatch.setattr(OffloadAdamW, "__init__", lambda *a, **k: built.append("optimizer"))
    monkeypatch.setattr(trl.SFTTrainer, "__init__", lambda *a, **k: built.append("trainer"))
    with pytest.raises(ValueError, match=match):
        HipferrySFTTrainer(model=tiny_llama(), args=sft_config(str(tmp_path), optim_args=optim_args),
                           train_dataset=tokenized_dataset(), processing_class=tiny_tokenizer())
    assert not built
