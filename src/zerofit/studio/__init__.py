"""`zerofit studio`: plan, launch, watch, compare and chat in a browser, on the command line's own code.

A small FastAPI app (`server.py`) served by uvicorn on 127.0.0.1, with the page's HTML, script and style
shipped in `static/` (no CDN). Every answer comes from the code the command line runs: the plan from
`zerofit.commands.plan.plan_report` (`zerofit plan --json`), launches through `launchers/launch_finetune.py`
with a validated config written into the run folder first (`launches.py`), the live curves from the run's
`metrics.jsonl` (`runs.py`), the comparison from `zerofit.metrics.compare` and the chat from
`zerofit.trained.generate` (`zerofit generate`). The page only shows what they return. `security.py`: the
token every request needs and the workspace root every path stays inside.
"""
