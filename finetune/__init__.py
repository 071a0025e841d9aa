"""Fine-tuning: datasets, the Attn-QAT training loop, checkpoints (installed as ``attnqat.finetune``)."""
