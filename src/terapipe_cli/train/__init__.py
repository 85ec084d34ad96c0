"""Stage 3, training — the launcher side: check a run and write its folder, start the torchrun workers, verify.

prepare.py     everything `terapipe train` checks before a worker starts, and the run folder it writes
rundir.py      the run folder's files and their schemas (config.json, metrics.jsonl, summary.json, lock)
launch.py      the workers' torchrun command (restarts); a worker failure, a signal or Ctrl-C as one line
worker.py      one torchrun worker: joins the process group and runs the engine's trainer over the run
checkpoint.py  per-stage checkpoints, complete only with a manifest of every file's size and checksum
saving.py      a worker's side of a checkpoint: written in the background, completed through one all-reduce
stop.py        stopping on SIGTERM, SIGUSR1 or Ctrl-C with a checkpoint of the step done
verify.py      the single-process reference and the comparison behind ``--verify``
baseline.py    a run's GPipe baseline, trained with the run's own settings
export.py      a run's checkpoint as one single-device model file
cluster.py     the per-node `terapipe train` commands and sbatch file of a plan (`terapipe launch-script`)
"""
