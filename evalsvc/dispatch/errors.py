"""The dispatchers' shared error (its own module, so that a backend and the package's chooser both
import it without importing each other)."""


class DispatchError(RuntimeError):
    """Runs cannot go where the settings send them; the message names the setting."""
