"""`make demo`'s two helpers, run as `python -m`: the demo's precision on this machine (`precision.py`: fp32
on a CPU without bfloat16 kernels, else the config's bf16) and its before/after scorer (`score.py`: format and
facts on held-out prompts, or the vision demo's held-out images). Neither is part of a run."""
