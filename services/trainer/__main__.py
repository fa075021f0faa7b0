"""`slipstream trainer`: the trainer. One process, or every rank under torchrun
(`torchrun --nproc-per-node 4 -m services.trainer --config run.yaml`): rank 0 serves the control surface, the other
ranks run the training loop only."""

import logging
import os
import sys

from services.common.errors import STOPPED, RunStopped
from services.common.server import main_for
from services.trainer.config import TrainerConfig
from services.trainer.server import build


def main(argv: list[str] | None = None) -> int:
    code = _run(argv)
    # Everything is written and flushed by now (checkpoints, TensorBoard after each step, the logs below). The
    # interpreter's teardown of torch's and megatron's native state ended a finished trainer now and then with
    # SIGABRT ("terminate called without an active exception"), turning a good run into a failed one: the process
    # ends here instead.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        return main_for("trainer", TrainerConfig, build, argv)
    from services.common.config import load_config
    from services.common.logs import setup_logging
    from services.trainer.loop import Trainer

    config = load_config(TrainerConfig, argv, prog="slipstream trainer")
    setup_logging(config.log_level, config.log_format)
    try:
        Trainer(config).run()
    except RunStopped as e:  # rank 0 says why
        logging.getLogger(__name__).info("stopped: %s", e)
        return STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
