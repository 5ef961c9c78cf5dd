"""Tiny Llama models from configs, data and Trainer runs shared by the integration tests."""
import contextlib
import math
import warnings

import torch

STEPS = 4


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def with_lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def dataset(n: int = 16, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (n, seq), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


# The arguments every test's run shares (TrainingArguments and TRL's SFTConfig take them alike).
COMMON_ARGS = dict(use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1, report_to=[],
                   save_strategy="no", seed=0, disable_tqdm=True, lr_scheduler_type="constant", learning_rate=1e-2,
                   max_grad_norm=0.05, data_seed=0)


def training_args(out_dir: str, **overrides):
    from transformers import TrainingArguments
    return TrainingArguments(**{**COMMON_ARGS, "output_dir": out_dir, **overrides})


def logged(trainer, key: str):
    return [h[key] for h in trainer.state.log_history if key in h]


@contextlib.contextmanager
def one_thread():
    """torch on one thread: the tiny models gain nothing from more, and on a shared 2-core
    machine spinning OpenMP workers made each run ~7x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(trainer_cls, model, args, resume=None, **kwargs):
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings(), one_thread():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = trainer_cls(model=model, args=args, train_dataset=kwargs.pop("train_dataset", dataset()), **kwargs)
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_close_lists(a, b, what, rtol=1e-4, atol=1e-5):
    assert len(a) == len(b) and a, f"{what}: {a} vs {b}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=rtol, abs_tol=atol), f"{what}[{i}]: {x} vs {y} (all: {a} vs {b})"


def trainable_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (t0 ... t127), built locally (no hub)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                   pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")


def tokenized_dataset():
    """dataset() as a datasets.Dataset of input_ids (SFTTrainer's pre-tokenized form)."""
    from datasets import Dataset
    return Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in dataset()]})


def sft_config(out_dir: str, **overrides):
    from trl import SFTConfig
    return SFTConfig(**{**COMMON_ARGS, "output_dir": out_dir, **overrides})
