"""A user's password change revokes their management-API tokens, on every write path.

A signal (not a call in each view) because the password is set in many places, most of them
Django's own code: the console's password page, the admin's own password page and its page
for another user's password (which can also disable password sign-in), ``manage.py
changepassword``, and any password-reset view added later. All of them call
``set_password`` (or ``set_unusable_password``) and then ``save``.

``_password`` is how Django tells them apart from a hash upgrade at sign-in: ``set_password``
keeps the new plaintext there until ``save`` has run the validators' ``password_changed``
(``django.contrib.auth.base_user``), while the upgrade clears it before saving, as the new
hash is the same password's. An upgrade therefore revokes nothing. A save that leaves the
password unusable revokes what the user still holds (they cannot obtain new tokens without a
password anyway). The revocation runs in the saving transaction: for a page, the request's
(``ATOMIC_REQUESTS``), so the password and the tokens change together; outside a request
(``changepassword``, a shell in autocommit) the save has committed already and the tokens
go in a transaction of their own right after it.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models.signals import post_save
from django.dispatch import receiver

from tenants import services
from tenants.models import ApiToken


def password_changed(user: Any, update_fields: frozenset[str] | None) -> bool:
    """Whether this save of an existing user set a new password or left it unusable."""
    if update_fields is not None and "password" not in update_fields:
        return False
    if getattr(user, "_password", None) is not None:
        return True
    return not user.has_usable_password() and ApiToken.objects.filter(user=user).exists()


@receiver(post_save, sender=settings.AUTH_USER_MODEL)
def _user_saved(sender: type, instance: Any, created: bool, **kwargs: Any) -> None:
    if not created and password_changed(instance, kwargs.get("update_fields")):
        services.user_password_changed(user=instance)
