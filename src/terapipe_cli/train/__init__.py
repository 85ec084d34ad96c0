"""Stage 3, training — the launcher side: check a run and write its folder, start the torchrun workers, verify.

prepare.py     everything `terapipe train` checks before a worker starts, and the run folder it writes
rundir.py      the run folder's files and their schemas (config.json, metrics.jsonl, summary.json, lock)
launch.py      the workers' torchrun command; a worker failure or Ctrl-C as one line
worker.py      one torchrun worker: joins the process group and runs the engine's trainer over the run
checkpoint.py  per-stage checkpoints, complete only when a marker says so
verify.py      the single-process reference and the comparison behind ``--verify``
baseline.py    a run's GPipe baseline, trained with the run's own settings
export.py      a run's checkpoint as one single-device model file
cluster.py     the per-node `terapipe train` commands and sbatch file of a plan (`terapipe launch-script`)
"""
