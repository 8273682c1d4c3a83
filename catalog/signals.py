"""Every catalog write, from wherever it comes, nudges placement once it is committed."""

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from .models import Model, Profile
from .services import reconcile_after_commit


@receiver(post_save, sender=Model)
@receiver(post_delete, sender=Model)
@receiver(post_save, sender=Profile)
@receiver(post_delete, sender=Profile)
def catalog_changed(sender, **kwargs) -> None:
    reconcile_after_commit()
