"""The engine: runs a model whose weights live in the store, one resident block at a time.

It drives each step downward: block discovery (``blocks``), the per-call paging and recompute
(``paged_call``, ``recompute``), the placeholders modules hold between calls (``placeholders``),
device slots and prefetch (``pager``, ``trace``), gradient offload (``grads``) and the engine that
ties them to one model (``runtime``). It calls the store and the optimizer; they never call back up.
"""
