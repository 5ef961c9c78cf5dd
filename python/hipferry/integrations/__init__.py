"""Entry points for Hugging Face trainers and Axolotl (docs/integrations.md).

Each submodule imports its framework when it is imported itself, so
``import hipferry`` never needs transformers, TRL or Axolotl:
- ``hipferry.integrations.transformers``: ``HipferryTrainer`` (transformers.Trainer);
- ``hipferry.integrations.trl``: ``HipferrySFTTrainer`` (trl.SFTTrainer);
- ``hipferry.integrations.axolotl``: ``HipferryPlugin`` (an Axolotl plugin);
- ``hipferry.integrations.options``: the config string/dict they all read.
"""
