"""Released weights as a starting point: a local Hugging Face folder (config.json, safetensors, tokenizer.json) read
into Kiln's model, tokenizer and checkpoint format.

``import_pretrained(folder, out_dir)`` (kiln.pretrained.source) does it whole; ``python -m kiln.pretrained FOLDER OUT``
from a shell. Safetensors only: a pickle checkpoint is refused, never loaded.
"""
