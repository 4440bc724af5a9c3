"""The offline demo model and LoRA adapter: built on the machine, never downloaded.

`model.py` builds a tiny random Qwen3 and its tokenizer from `data/` (a corpus and
Qwen3's chat template, package data); `lora_adapter.py` writes random PEFT LoRA
adapters for it. So every path runs for real on a machine with no GPU and no
network (docs/DESIGN.md, "On a machine without a GPU").
"""
