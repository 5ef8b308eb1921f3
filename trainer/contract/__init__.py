"""The trainer's torch-free contract: everything gptop and the tuner may import.

- `config`: the one configuration object (sections, flags, TOML, validation), re-exported from its
  parts: `config_schema`, `config_options`, `config_layouts`, `config_files`, `config_args`.
- `events`: the one event schema (typed events, parsing, JSON lines).
- `device`: the device description as data (`DeviceInfo`); probing it needs torch
  and lives in `trainer.device_probe`.
- `capabilities`: which toggle values a device supports, runs slowly, or lacks.
- `rundir`: the run-directory layout: run naming, checkpoint paths, listing,
  pruning and pinning.
- `inputs`: the checks of every path a user gives (config, data, tokenizer, model,
  resume, run directory, tuning storage), run where it enters.
- `protect`: what gptop may delete or replace on a user's word (`export --force`
  replaces an earlier export, never a run, its checkpoints or a folder holding one).
- `runlock`: one writer per run directory (an flock on `RUN_DIR/.gptop.lock`, per
  node for a multi-node run).
- `atomic`: the one atomic write, and `DiskError`: a write a full or read-only
  filesystem refused, named once at that boundary.

Nothing in this package imports torch at module level (a test enforces it), so
`gptop --help` and the dashboard's first frame never wait for `import torch`.
The trainer's torch code builds on these modules; gptop/ and tuner/ import only
them.
"""
