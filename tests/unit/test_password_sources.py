"""Where the etcd password comes from: ``password``, ``password_file`` or the environment
(torchrun logs ``--rdzv-conf``, so a password given there would be in its log)."""

from __future__ import annotations

from pathlib import Path

import pytest

from etcd_rendezvous._transport.options import PASSWORD_ENV, etcd_password
from etcd_rendezvous.api import RendezvousParameters


def params(**options: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v2", "127.0.0.1:2379", "job", 1, 1, **options)


@pytest.fixture(autouse=True)
def no_password_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


def test_the_password_option_as_given() -> None:
    assert etcd_password(params(username="u", password="s3cret")) == "s3cret"
    assert etcd_password(params()) is None


def test_the_first_line_of_the_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\nignored\n")
    assert etcd_password(params(username="u", password_file=str(secret))) == "s3cret"


def test_the_environment_when_a_user_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert etcd_password(params(username="u")) == "from-env"
    # Without a user the variable is not read (no auth wanted).
    assert etcd_password(params()) is None
    # The options come first.
    assert etcd_password(params(username="u", password="opt")) == "opt"


def test_password_and_password_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="password, password_file"):
        etcd_password(params(username="u", password="a", password_file=str(tmp_path)))


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_an_unreadable_or_empty_file_names_the_option_and_the_file(
    tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "password"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="password_file") as raised:
        etcd_password(params(username="u", password_file=str(path)))
    assert str(path) in str(raised.value)
