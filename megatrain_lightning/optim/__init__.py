"""The optimizer: CPU AdamW over the store (``adamw``), its update scheduling (``updates``), its state in
torch's format (``state_dict``), the rebuild of the user's optimizer (``rebuild``), and compressed moments:
codecs (``codecs``), the fused step (``quantized``) and its compiled kernel (``kernel``)."""
