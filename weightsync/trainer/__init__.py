"""The trainer side: which tensors of the trainer's model the engine receives, under which
names, in which order (``tensors``), in checkpoint layout (``layout``), for which PEFT set-ups
(``peft_support``), gathered from shards (``gather``). Nothing here knows an engine."""
