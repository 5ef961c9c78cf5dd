"""HipferryPlugin (hipferry.integrations.axolotl) through Axolotl's own
PluginManager, config merge and AxolotlTrainer (axolotl 0.19.0, installed
without its dependencies: it pins torch<=2.13; see docs/integrations.md).
The YAML keys validate in Axolotl's merged pydantic config and bad ones are
refused naming the key; after post_trainer_create an AxolotlTrainer trains
with OffloadAdamW (8-bit state here), clips through it, and its losses equal
HipferryTrainer's with the same options in optim_args."""
from dataclasses import dataclass

import pytest

pytest.importorskip("transformers")
base = pytest.importorskip("axolotl.integrations.base")
pydantic = pytest.importorskip("pydantic")

from hf_trainer_helpers import (assert_close_lists, dataset, logged, one_thread, tiny_llama, train,  # noqa: E402
                                training_args)

from hipferry.integrations.axolotl import HipferryArgs, HipferryPlugin  # noqa: E402
from hipferry.integrations.transformers import HipferryTrainer  # noqa: E402
from hipferry.optim import OffloadAdamW  # noqa: E402

NAME = "hipferry.integrations.axolotl.HipferryPlugin"


@pytest.fixture
def manager():
    pm = base.PluginManager.get_instance()
    pm.register(NAME)
    yield pm
    pm.plugins.pop(NAME, None)  # (a process-wide singleton)


def test_plugin_registers_and_its_keys_join_axolotls_config(manager):
    assert isinstance(manager.plugins[NAME], HipferryPlugin)
    assert isinstance(manager.plugins[NAME], base.BasePlugin)
    assert manager.get_input_args() == ["hipferry.integrations.axolotl.HipferryArgs"]
    from axolotl.integrations.config import merge_input_args
    _, input_config = merge_input_args()
    assert {"hipferry_state", "hipferry_overlap", "hipferry_state_dir"} <= set(input_config.model_fields)


@pytest.mark.parametrize("cfg,match", [
    ({"hipferry_state": "ssd"}, r"option 'state' must be one of 'host', 'host8', 'disk', 'disk8', got 'ssd'"),
    ({"hipferry_state": "disk"}, r"state=disk needs the option 'state_dir'"),
    ({"hipferry_overlap": "always"}, r"option 'overlap' must be one of 'none', 'backward'"),
    ({"hipferry_disk_window": "big"}, r"option 'disk_window' must be a byte count"),
])
def test_bad_keys_fail_config_validation(cfg, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        HipferryArgs(**cfg)


def axolotl_trainer(out_dir, **overrides):
    trainers = pytest.importorskip("axolotl.core.trainers.base")  # needs numba (installed without deps in CI)
    from axolotl.core.training_args_base import AxolotlTrainingMixins
    from datasets import Dataset
    from transformers import TrainingArguments

    @dataclass
    class Args(AxolotlTrainingMixins, TrainingArguments):  # = axolotl.core.training_args.AxolotlTrainingArguments,
        pass                                              # whose module needs a TRL older than the one tested
    rows = [r["input_ids"].tolist() for r in dataset()]
    args = training_args(out_dir, **overrides)
    kwargs = {k: v for k, v in args.to_dict().items() if k in {f for f in Args.__dataclass_fields__}}
    return trainers.AxolotlTrainer(model=tiny_llama(), args=Args(**{**kwargs, "output_dir": out_dir}),
                                   train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}))


def test_axolotl_trainer_trains_with_offload_adamw(tmp_path, manager):
    from axolotl.utils.dict import DictDefault
    cfg = DictDefault(plugins=[NAME], hipferry_state="host8", hipferry_overlap="backward")
    manager.cfg = cfg
    trainer = axolotl_trainer(str(tmp_path / "axolotl"), optim="adamw_torch")
    manager.post_trainer_create(cfg, trainer)
    assert type(trainer).__name__ == "HipferryAxolotlTrainer"
    opt = manager.create_optimizer(trainer)
    assert isinstance(opt, OffloadAdamW) and opt is trainer.hipferry_optimizer()
    with one_thread():
        trainer.train()
    assert trainer.optimizer.optimizer is opt
    assert any(s.get("exp_avg") is not None and s["exp_avg"].dtype.itemsize == 1 for s in opt.state.values())
    ref = train(HipferryTrainer, tiny_llama(), training_args(str(tmp_path / "ref"),
                                                             optim_args="state=host8,overlap=backward"))
    assert_close_lists(logged(trainer, "loss"), logged(ref, "loss"), "loss", rtol=1e-6)
    assert_close_lists(logged(trainer, "grad_norm"), logged(ref, "grad_norm"), "grad_norm", rtol=1e-6)


def test_plugin_refuses_a_non_adamw_optim(tmp_path):
    from axolotl.utils.dict import DictDefault
    trainer = axolotl_trainer(str(tmp_path), optim="sgd")
    with pytest.raises(ValueError, match=r"TrainingArguments.optim must be one of adamw_torch"):
        HipferryPlugin().post_trainer_create(DictDefault(hipferry_state="host"), trainer)


def test_without_axolotl_the_plugin_keeps_its_interface(monkeypatch):
    """axolotl not importable: a fresh copy of the module falls back to its stand-in base
    and still turns a config into options and adopts a trainer."""
    import importlib.util
    import sys

    import hipferry.integrations.axolotl as real
    monkeypatch.setitem(sys.modules, "axolotl.integrations.base", None)  # import raises ImportError
    spec = importlib.util.spec_from_file_location("hipferry.integrations._axolotl_copy", real.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.BasePlugin is not base.BasePlugin
    plugin = copy.HipferryPlugin()
    assert plugin.get_input_args().endswith(".HipferryArgs")
    options = copy.options_from_cfg({"hipferry_state": "host8", "hipferry_overlap": False})
    assert (options.state, options.overlap) == ("host8", "none")
