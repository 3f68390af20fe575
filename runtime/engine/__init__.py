"""The engine: everything that touches MLX for one loaded model.

Import from the modules themselves (this package re-exports nothing, so that
``python -m runtime.engine.process`` and a fake-driven test load only what
they use):

* ``core``: ``EngineCore``, the sans-IO state machine (commands in, one
  ``StepOutputs`` per step out) around a batch generator and the prompt cache;
* ``sequences``: ``SequenceRecord`` (the core's record of one sequence),
  ``token_event`` (a generator's response -> ``TokenEvent``), and the prompt
  segments past the prompt cache's hit (``uncached_segments``);
* ``inserts``: ``SequenceInserts``, a sequence's sampling and its insert into
  the batch generator;
* ``counters``: ``EngineCounters``, the running totals behind ``EngineStats``;
* ``failures``: ``SequenceError`` (one sequence fails), ``EngineBroken``
  (the engine does), ``failed_step`` (what a failed batch's requests are told,
  and whether they may retry);
* ``choices``: several choices of one request (n > 1) sharing its prefill.
* ``serial``: ``SerialGenerator``, mlx-lm's ``stream_generate`` behind the
  batch generator's interface (draft model, quantized KV cache).
* ``commands``: ``CommandSource`` (``LocalCommands``, ``SharedCommands`` for a
  distributed group) and ``drain``: what each loop round applies.
* ``loop``: ``run_engine_loop`` (the engine thread's body),
  ``run_follower_loop`` and ``run_follower`` (distributed ranks > 0).
* ``process``: the engine in a child process (``python -m
  runtime.engine.process FD``) and the parent's side, ``run_engine_proxy``.
* ``loading``: ``make_engine_core`` and ``load_tokenizer`` from mlx-lm parts.

Dependencies among them point one way: loading -> serial, core;
core -> commands, sequences, inserts, counters, failures; serial -> failures;
loop -> core, process -> loop.
"""
