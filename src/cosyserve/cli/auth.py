"""``cosyserve auth``: make the hashed entries that the server's auth settings hold.

``cosyserve auth hash-key NAME`` makes a new random API key and prints it once, with the
``NAME:scrypt$...`` entry for ``auth_api_keys`` (or a keys file); with ``--stdin`` it
hashes a secret read from standard input instead (an existing key, or a password for
``auth_basic_users``), so the secret never appears in the shell history or process list.
"""

import sys
from typing import Annotated

import typer

auth_app = typer.Typer(help="Credentials for the server's authentication.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.add_typer(auth_app, name="auth")


@auth_app.command("hash-key")
def hash_key(
    name: Annotated[str, typer.Argument(help="Key or user name (the identity for logs and rate limits).")],
    stdin: Annotated[
        bool, typer.Option("--stdin", help="Hash the secret on standard input instead of a new key.")
    ] = False,
) -> None:
    """Print a salted scrypt entry NAME:HASH (and the new key, unless --stdin)."""
    from cosyserve.server.auth.keys import hash_secret, new_api_key
    from cosyserve.server.settings import SettingsError

    if not name.strip() or ":" in name or "," in name:
        raise SettingsError("the name must be non-empty, without ':' or ','")
    if stdin:
        secret = sys.stdin.readline().rstrip("\r\n")
        if not secret:
            raise SettingsError("no secret on standard input")
    else:
        secret = new_api_key()
        typer.echo(f"key:   {secret}")
    typer.echo(f"entry: {name.strip()}:{hash_secret(secret)}")
