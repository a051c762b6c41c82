"""Activation oracles: a LoRA of the target model that answers questions about its activations.

qa_items (the question-answer items, held-out groups), prompt (the oracle prompt, placeholders),
inference (capture, the injection vector, answers; used offline and by the Inspect solver),
lora_training (peft), evaluate, adapters (trained oracles on disk, their cards and recipes),
build (``lens-evals oracle train``)."""
