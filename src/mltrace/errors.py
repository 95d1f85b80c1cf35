"""Exceptions that carry a message meant for the user."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
