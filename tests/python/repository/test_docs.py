"""The repository's own documentation: every relative link of the README,
docs/ and the source folders' READMEs leads to a file that exists (and to a heading that exists, where it
names one), every such page is reachable from the README in at most two
clicks, and the README stays a front door (about 200 lines at most)."""

import os
import re

ROOT = __file__.rsplit("/tests/", 1)[0]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    """The README first, then docs/ and the source folders' READMEs."""
    docs = os.path.join(ROOT, "docs")
    folders = ["backend", "coordinator", "common", "coordinator/cpu",
               "coordinator/cuda", "coordinator/faults", "coordinator/debug",
               "custom_allreduce", "message_queue", "message_queue/region",
               "message_queue/ring", "message_queue/arena", "message_queue/collectives"]
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md")) + [
        os.path.join(ROOT, f, "README.md") for f in folders]


def _anchor(heading):
    # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    with open(path) as f:
        return {_anchor(line.lstrip("#")) for line in f if re.match(r"#{1,6} ", line)}


def _links(path):
    with open(path) as f:
        text = f.read()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
            if file_part else path
        out.append((target, resolved, anchor))
    return out


def test_every_link_leads_somewhere():
    broken = []
    for page in _pages():
        for target, resolved, anchor in _links(page):
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_is_within_two_clicks_of_the_readme():
    readme = os.path.join(ROOT, "README.md")
    first = {r for _, r, _ in _links(readme) if r.endswith(".md")}
    second = {r for page in first if os.path.exists(page) for _, r, _ in _links(page)}
    unreachable = [os.path.relpath(p, ROOT) for p in _pages()[1:]
                   if p not in first and p not in second]
    assert not unreachable, unreachable


def test_the_readme_is_a_front_door():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move the detail into docs/"
