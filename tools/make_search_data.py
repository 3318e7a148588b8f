"""Generate the shipped multi-hop QA set for the ``search`` environment (fictional entities).

    python -m tools.make_search_data [OUT_DIR]   # default: stages/envs/data/multihop

Deterministic from ``SEED``: a small world of people, cities, novels, films, companies and products,
one passage per entity (``corpus.jsonl``), and 200 questions (``questions.jsonl``) in HotpotQA's
format. Bridge questions need two searches (the first passage names the entity whose passage holds
the answer, and no passage holds both the question's entity and the answer); comparison questions
need both compared passages. Everything is invented, so a model cannot answer from memory.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20261129
OUT = Path(__file__).resolve().parents[1] / "stages" / "envs" / "data" / "multihop"

ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "st",
    "th",
)
VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
CODAS = ("", "n", "r", "l", "s", "th", "nd", "rk", "m")
ADJECTIVES = (
    "silent",
    "golden",
    "hollow",
    "crimson",
    "distant",
    "frozen",
    "hidden",
    "broken",
    "velvet",
    "burning",
    "quiet",
    "endless",
    "glass",
    "iron",
    "paper",
    "last",
    "wandering",
    "sleeping",
    "northern",
    "painted",
)
NOUNS = (
    "harbor",
    "orchard",
    "lantern",
    "river",
    "garden",
    "compass",
    "mirror",
    "tower",
    "meadow",
    "voyage",
    "winter",
    "letter",
    "island",
    "kingdom",
    "forest",
    "bridge",
    "feather",
    "machine",
    "signal",
    "summer",
)
PROFESSIONS = (
    "novelist",
    "film director",
    "painter",
    "engineer",
    "chemist",
    "architect",
    "composer",
    "entrepreneur",
)
INDUSTRIES = ("textile", "shipbuilding", "software", "pharmaceutical", "railway", "toy", "brewing", "optics")
PRODUCT_KINDS = (
    "bicycle",
    "camera",
    "typewriter",
    "kettle",
    "radio",
    "telescope",
    "sewing machine",
    "wristwatch",
)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class Names:
    """Unique invented names."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(
                self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                for _ in range(syllables)
            )
            if w not in self.used and 4 <= len(w) <= 11:
                self.used.add(w)
                return w.capitalize()

    def title(self) -> str:
        while True:
            t = f"The {self.rng.choice(ADJECTIVES).capitalize()} {self.rng.choice(NOUNS).capitalize()}"
            if t not in self.used:
                self.used.add(t)
                return t


def build(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(questions, passages) of the generated world."""
    rng = random.Random(seed)
    names = Names(rng)
    countries = [names.word(2) + "ia" for _ in range(6)]
    cities = [
        {
            "name": names.word(2),
            "country": rng.choice(countries),
            "river": f"{names.word(2)} River",
            "population": rng.randrange(20, 900) * 1000,
        }
        for _ in range(40)
    ]
    years = rng.sample(range(1850, 1995), 140)
    people = []
    for i in range(70):
        profession = PROFESSIONS[i % len(PROFESSIONS)]
        people.append(
            {
                "name": f"{names.word(2)} {names.word(2)}",
                "year": years[i],
                "city": rng.choice(cities),
                "profession": profession,
            }
        )
    by_prof = {p: [x for x in people if x["profession"] == p] for p in PROFESSIONS}
    works = []
    for i in range(60):
        kind = "novel" if i % 2 == 0 else "film"
        creator = rng.choice(by_prof["novelist" if kind == "novel" else "film director"])
        works.append(
            {"title": names.title(), "kind": kind, "creator": creator, "year": rng.randrange(1900, 2020)}
        )
    founding = rng.sample(range(1820, 2010), 30)
    companies = []
    for i in range(30):
        companies.append(
            {
                "name": f"{names.word(2)} {rng.choice(('Works', 'Industries', 'Company', 'Group'))}",
                "year": founding[i],
                "founder": rng.choice(by_prof["entrepreneur"] + by_prof["engineer"]),
                "industry": rng.choice(INDUSTRIES),
                "hq": rng.choice(cities),
            }
        )
    products = []
    for _ in range(30):
        products.append(
            {
                "name": f"{names.word(2)} {rng.choice(PRODUCT_KINDS)}",
                "maker": rng.choice(companies),
                "since": rng.randrange(1950, 2020),
            }
        )

    passages: list[dict] = []

    def add(title: str, text: str) -> None:
        passages.append({"id": f"p{len(passages)}", "title": title, "text": text})

    for c in cities:
        add(
            c["name"],
            f"{c['name']} is a city in {c['country']} on the banks of the {c['river']}. "
            f"It has a population of about {c['population']:,}.",
        )
    for p in people:
        add(
            p["name"],
            f"{p['name']} (born {p['year']}) is {article(p['profession'])} {p['profession']} who was born in the city of "
            f"{p['city']['name']}.",
        )
    for w in works:
        verb = "written by" if w["kind"] == "novel" else "directed by"
        add(w["title"], f"{w['title']} is a {w['year']} {w['kind']} {verb} {w['creator']['name']}.")
    for c in companies:
        add(
            c["name"],
            f"{c['name']} is {article(c['industry'])} {c['industry']} company founded in {c['year']} by {c['founder']['name']}. "
            f"It is headquartered in {c['hq']['name']}.",
        )
    for p in products:
        add(
            p["name"],
            f"The {p['name']} is a product manufactured by {p['maker']['name']} since {p['since']}.",
        )

    questions: list[dict] = []

    def ask(kind: str, question: str, answer: str, titles: list[str]) -> None:
        questions.append(
            {
                "id": f"q{len(questions):03d}",
                "question": question,
                "answers": [answer],
                "type": kind,
                "supporting_titles": titles,
            }
        )

    novels = [w for w in works if w["kind"] == "novel"]
    films = [w for w in works if w["kind"] == "film"]
    for w in rng.sample(novels, 30):
        ask(
            "bridge",
            f"In which city was the author of the novel {w['title']} born?",
            w["creator"]["city"]["name"],
            [w["title"], w["creator"]["name"]],
        )
    for w in rng.sample(films, 25):
        ask(
            "bridge",
            f"In what year was the director of the film {w['title']} born?",
            str(w["creator"]["year"]),
            [w["title"], w["creator"]["name"]],
        )
    for c in rng.sample(companies, 25):
        ask(
            "bridge",
            f"In which city was the founder of {c['name']} born?",
            c["founder"]["city"]["name"],
            [c["name"], c["founder"]["name"]],
        )
    for p in rng.sample(people, 40):
        ask(
            "bridge",
            f"Which river flows through the birthplace of {p['name']}?",
            p["city"]["river"],
            [p["name"], p["city"]["name"]],
        )
    for p in rng.sample(products, 25):
        ask(
            "bridge",
            f"In what year was the company that makes the {p['name']} founded?",
            str(p["maker"]["year"]),
            [p["name"], p["maker"]["name"]],
        )
    for _ in range(28):
        a, b = rng.sample(companies, 2)
        first = a if a["year"] < b["year"] else b
        ask(
            "comparison",
            f"Which company was founded earlier, {a['name']} or {b['name']}?",
            first["name"],
            [a["name"], b["name"]],
        )
    for _ in range(27):
        a, b = rng.sample(people, 2)
        first = a if a["year"] < b["year"] else b
        ask(
            "comparison",
            f"Who was born first, {a['name']} or {b['name']}?",
            first["name"],
            [a["name"], b["name"]],
        )
    return questions, passages


def write(out: Path = OUT, seed: int = SEED) -> None:
    """Write questions.jsonl and corpus.jsonl under ``out``."""
    questions, passages = build(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("questions.jsonl", questions), ("corpus.jsonl", passages)):
        tmp = out / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        tmp.replace(out / name)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
