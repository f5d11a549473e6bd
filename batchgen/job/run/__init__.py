"""Running a job: the run loop (``runner``), one run per shard (``lock``), progress, ``status``
of an output dir, and Slurm array scripts."""
