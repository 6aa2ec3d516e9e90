"""Megatron-LM checkpoints (legacy and torch_dist), read and written: the ``megatron`` format.

The modules form layers, each importing only those below it:

* ``format``: the format object (``detect``, ``open``, ``write``);
* reading and writing: ``read_legacy``, ``read_torch_dist``, ``write_legacy``, ``write_torch_dist``;
* ``source``: what both readers share (the model from the args, the tensors checked against it);
* optimizer state: ``legacy_optimizer`` (the regular optimizer in legacy files),
  ``torch_dist_optimizer`` (per-parameter state in torch_dist files), ``buffer_optimizer`` (the
  distributed optimizer's gradient-buffer layout, both formats), ``param_order`` and ``chained``;
* ``layout``: tensor-parallel splits, pipeline stages and chunks, experts' splits, vocabulary rows;
* ``args``, ``bert_args``, ``t5_args``, ``deepseek_args``: Megatron-LM's args <-> mega's model configs;
* ``names``: each family's names in Megatron-LM's files (each table registers itself);
* ``directory``, ``pickles``: save directories and rank files; ``torch.load`` with an allowlist.
"""
