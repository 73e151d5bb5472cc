"""The unit tier: tests in folders that mirror `src/zerofit/`'s packages. This file puts `tests/unit/` on the
import path, so every test imports the shared helpers beside it (`_deepspeed_world`, `metrics_fixtures`, `planted_pickle`)."""
