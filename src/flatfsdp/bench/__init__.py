"""`python -m flatfsdp.bench`: flatfsdp against PyTorch FSDP2, DeepSpeed ZeRO-3
and the no-communication compute floor, on the same model, seed, batches and
world size, in alternating runs.

Files, one concept each:

* ``options``   -- the frozen run configuration, presets and the command line;
* ``gpu_preset`` -- ``--preset gpu``: a 1.2B Llama on one GPU, and why it fits (docs/gpu.md);
* ``workload``  -- the model (GPT or Llama), its seeded batches, the optimizer every contender uses;
* ``flops``     -- model FLOPs of a step, for TFLOP/s;
* ``contenders``/``floor``/``ds``  -- how each contender wraps the model and takes one step;
* ``comm_bytes`` -- bytes per collective kind seen at the torch.distributed layer;
* ``memory``    -- peak memory per rank above a baseline;
* ``theory``    -- minimum bytes communicated and model-state bytes per strategy;
* ``measure``   -- one contender run on one rank (what the launched ranks execute);
* ``runner``    -- the alternating schedule, one fresh process group per run;
* ``run_records`` -- each run's record, one JSON line in runs.jsonl as the run ends;
* ``report``    -- medians, ratios and loss agreement from the run records;
* ``tables``/``chart`` -- the markdown tables and chart.png (``__main__`` writes results.json);
* behind a throttled link (``--link``, ``--nnodes 2``): ``netsim`` (the namespaces, made by
  its netsim_scripts), ``link_runs`` (each run as torchrun per node inside them), ``link_rank``
  (what those ranks run), ``link_counters`` (crossing bytes: interface counters and the
  engine's per-peer account), ``wire`` (the wire limit) and ``wire_table``; with
  ``--link-timeline``, ``link_sampler`` (the link's counter every 2 ms, a process of its
  own), ``link_activity`` (when in a step the link sat idle) and ``timeline_table``.
"""
