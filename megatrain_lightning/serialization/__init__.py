"""Moving weights in and out without materializing the model: safetensors shards (``safetensors_io``),
checkpoint directories (``checkpoint``), Hugging Face load and export (``hf``), building on the meta
device (``meta``) and initializing such a build exactly as a plain one would be (``initialization``).
"""
