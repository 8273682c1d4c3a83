"""An import-linter contract type: what a package may import, as an allow-list.

import-linter's own contracts say what may not be imported (forbidden, layers); the
node side wants the other way round: the agent may import the standard library and the
modules named, and nothing else, so that a module added anywhere later (a new app, a
new `llmgw_site` module, a package the control plane installs) is refused without
anyone remembering to forbid it. The allowed first-party packages are followed too: what
they import is what the node loads.

The list is written once, in pyproject.toml's contract; tests/test_layers.py reads the
same list (`allowed_modules`) for its check of what a running node loads.
"""

from __future__ import annotations

import sys

from importlinter import Contract, ContractCheck, fields, output


def within(module: str, names) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


class AllowListContract(Contract):
    """Configuration: `source_modules` (the packages checked), `allowed_modules` (what they
    may import besides themselves: packages, modules or third-party top-level names) and
    `allow_standard_library` (true by default)."""

    type_name = "allowlist"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())
    allow_standard_library = fields.BooleanField(required=False, default=True)

    def check(self, graph, verbose: bool) -> ContractCheck:
        sources = list(self.source_modules)
        allowed = list(self.allowed_modules)
        first_party = {module.split(".")[0] for module in graph.modules if not graph.is_module_squashed(module)}
        stdlib = sys.stdlib_module_names if str(self.allow_standard_library).lower() == "true" else frozenset()

        seen: set[str] = set()
        todo = [m for m in graph.modules if within(m, sources)]
        refused: list[dict] = []
        while todo:
            importer = todo.pop()
            if importer in seen:
                continue
            seen.add(importer)
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if within(imported, sources):
                    continue
                top = imported.split(".")[0]
                if top in stdlib and top not in first_party:
                    continue
                if within(imported, allowed):
                    if top in first_party:
                        todo.append(imported)  # what an allowed first-party module imports, the node loads too
                    continue
                lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
                refused.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(kept=not refused, warnings=[], metadata={"refused": refused})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in sorted(check.metadata["refused"], key=lambda i: (i["importer"], i["imported"])):
            lines = ", ".join(f"l.{n}" for n in item["lines"]) or "?"
            output.print_error(
                f"{item['importer']} imports {item['imported']} ({lines}), which is not in allowed_modules", bold=False
            )
            output.new_line()
