"""Tensor parallelism: one component on N ranks as one group.

``group.py`` (which groups a placement asks for, the rendezvous the server holds, one rank's
``torch.distributed`` membership), ``heads.py`` (how attention and KV heads split),
``shard.py`` (a Hugging Face checkpoint loaded shard by shard with transformers' own TP plan)
and ``runner.py`` (``TPRunner``: the same batch on every rank, the leader's result back).
Imported from their modules, not re-exported here, so that importing the package costs
nothing."""
