"""A password hasher for the test process: Django's own PBKDF2, with fewer rounds.

Django's default (1,000,000 rounds of PBKDF2-SHA256) costs about half a second a password
on this machine, and a test that signs in four staff members paid it four times. The hashes
this one makes are ordinary `pbkdf2_sha256$1000$...` strings: the default hasher of any
process the tests start (an admin server, a gateway) reads them too, since the rounds are
written in the hash.
"""

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FewRoundsPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1000
