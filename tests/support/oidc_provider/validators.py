from oauth2_provider.oauth2_validators import OAuth2Validator


class GroupsValidator(OAuth2Validator):
    """The standard claims, and the person's groups under "groups" when the client asked for that scope."""

    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "groups"}

    def get_additional_claims(self, request):
        user = request.user
        return {
            "email": user.email,
            "email_verified": True,
            "preferred_username": user.username,
            "given_name": user.first_name,
            "family_name": user.last_name,
            "groups": sorted(user.groups.values_list("name", flat=True)),
        }

    # prompt=none (llmgw's session refresh). oauthlib asks these of every such request and the
    # toolkit does not answer them: its view has already sent a person not signed in here back
    # with login_required (a disabled account is not signed in: Django's session no longer finds
    # it), and it asks for consent unless a grant still lasts (REQUEST_APPROVAL_PROMPT "auto").
    def validate_silent_login(self, request):
        return True

    def validate_silent_authorization(self, request):
        return True
