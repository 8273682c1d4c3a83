"""The API's own pagination and JSON parser: DRF's, with bounds that keep a bad request a 400."""

from rest_framework.exceptions import ParseError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import JSONParser

# Past this, an offset only ever finds nothing; and a number too large for the
# database's integers was a 500 (`?limit=99999999999999999999`).
MAX_OFFSET = 2**53


class Pagination(LimitOffsetPagination):
    default_limit = 100
    max_limit = 1000

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), MAX_OFFSET)


class BoundedJSONParser(JSONParser):
    """JSON nested past what Python's parser can follow is a 400 with a sentence, not a 500."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the request body is nested too deeply") from None
