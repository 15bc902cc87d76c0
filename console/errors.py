"""Errors the front doors report as one clear line."""


class UserError(Exception):
    """Bad input from the command line: printed as one clear line, exit status 2."""
