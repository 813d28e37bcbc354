"""The store: the authoritative copy of every block's numbers (weights, gradient sums, optimizer state).

``layout`` says where each parameter lives in a block's flat buffer; ``host`` keeps every buffer in
RAM; ``disk`` keeps them in files (``io``) with a bounded RAM cache (``arena``); ``memory`` allocates
page-aligned (and on CUDA exactly page-locked) host memory; ``preflight`` checks folders, disk and
RAM before anything is written.
"""
