"""The trainer side, run in the trainer's process: which tensors of the trainer's model the
engine receives, under which names, in which order (``tensors``), in checkpoint layout
(``layout``, applying ``wire.checkpoint_names``), for which PEFT set-ups (``peft_support``),
gathered from shards (``gather``). Nothing here knows an engine."""
