"""Weight sync in one home: the protocol (`protocol`), one module a transport with the trainer's and the gateway's
halves side by side (`broadcast`, `streamed`, `handles`, `disk`, `lora`, on the bases in `halves`), the table that
picks them and checks the run's settings (`factory`), and the torch side the trainer, the receivers and the engines
share (`group`: the weight group and bucket layouts; `delta`; `tensors`; `folders`: disk syncs' folder names). A
shared layer over services/common: it imports no service."""
