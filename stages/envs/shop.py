"""``shop``: a WebShop-style store over a generated catalog (pure Python).

The catalog (product types, attributes, options, prices) is deterministic from ``catalog_seed``; a
task is a goal product's instruction in WebShop's style ("i need a t-shirt with cotton, short
sleeve, and color: navy, and size: large, and price lower than 40.00 dollars"). Pages follow
WebShop's text mode (fields separated by ``[SEP]``): search, results (``page_size`` per page), item
(options, title, price), and the item's description / features pages.

Actions (WebShop's syntax, lowercase): ``search[query]`` on the search page — the admissible queries
are the catalog's product types, so every action set is finite (choose mode works) — and
``click[...]`` on the other pages: ``back to search``, ``next >``, ``< prev``, an item id, an option
value, ``description``, ``features``, ``buy now``.

Score (WebShop paper, Yao et al. 2022, Eq. for r)::

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price]) / (|U_att| + |U_opt| + 1)

with U the instruction's attributes / options / price bound and Y the bought product's attributes,
the options selected at purchase and its price; r_type = 1 for the instruction's product type, 0.5
for another type of the same category, 0 otherwise (WebShop's text-matching r_type is replaced by the
known type of a generated product). Success = score 1; outcome ``success_outcome`` = 10 on success,
0 otherwise; the score is recorded on the transition. State key = page identity + query + result page
+ item + selected options (not the raw text).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from stages.envs.base import Observation, Task, Transition
from stages.envs.tasksets import build_task_list, check_options

ENV_NAME = "shop"

# product type -> (category, attributes, {option dimension: values})
PRODUCT_TYPES: dict[str, tuple[str, tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "t-shirt": (
        "clothing",
        ("cotton", "short sleeve", "machine wash", "slim fit", "moisture wicking", "crew neck"),
        {
            "color": ("black", "white", "navy", "red", "grey", "green"),
            "size": ("small", "medium", "large", "x-large"),
        },
    ),
    "hoodie": (
        "clothing",
        ("fleece", "long sleeve", "machine wash", "zip up", "relaxed fit", "kangaroo pocket"),
        {
            "color": ("black", "grey", "navy", "maroon", "olive"),
            "size": ("small", "medium", "large", "x-large"),
        },
    ),
    "running shoes": (
        "shoes",
        ("non slip", "rubber sole", "lightweight", "breathable", "memory foam", "arch support"),
        {"color": ("black", "white", "blue", "pink", "grey"), "size": ("7", "8", "9", "10", "11")},
    ),
    "sandals": (
        "shoes",
        ("open toe", "ankle strap", "rubber sole", "water resistant", "arch support", "quick drying"),
        {"color": ("brown", "black", "beige", "white"), "size": ("6", "7", "8", "9", "10")},
    ),
    "shampoo": (
        "beauty",
        ("sulfate free", "paraben free", "natural ingredients", "for dry hair", "cruelty free", "vegan"),
        {"scent": ("coconut", "lavender", "mint", "argan oil"), "size": ("8 fl oz", "16 fl oz", "32 fl oz")},
    ),
    "face cream": (
        "beauty",
        ("anti aging", "hyaluronic acid", "fragrance free", "for sensitive skin", "spf 30", "oil free"),
        {"size": ("1.7 oz", "2.5 oz", "4 oz"), "scent": ("unscented", "rose", "cucumber")},
    ),
    "coffee": (
        "grocery",
        ("organic", "fair trade", "dark roast", "non gmo", "whole bean", "low acid"),
        {
            "flavor": ("vanilla", "hazelnut", "caramel", "original"),
            "size": ("12 ounce", "2 pound", "5 pound"),
        },
    ),
    "protein bar": (
        "grocery",
        ("gluten free", "high protein", "low sugar", "keto friendly", "plant based", "individually wrapped"),
        {"flavor": ("chocolate", "peanut butter", "cookie dough", "berry"), "size": ("12 count", "24 count")},
    ),
    "headphones": (
        "electronics",
        ("wireless", "noise cancelling", "bluetooth", "long battery life", "over ear", "built-in microphone"),
        {"color": ("black", "white", "silver", "blue"), "style": ("standard", "pro", "sport")},
    ),
    "phone case": (
        "electronics",
        ("shockproof", "slim", "wireless charging compatible", "clear", "kickstand", "screen protector"),
        {
            "color": ("black", "clear", "purple", "pink", "blue"),
            "model": ("iphone 13", "iphone 14", "galaxy s22"),
        },
    ),
    "desk lamp": (
        "home",
        ("led", "dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm"),
        {"color": ("black", "white", "silver"), "style": ("modern", "classic", "minimalist")},
    ),
    "throw pillow": (
        "home",
        ("decorative", "machine washable", "hidden zipper", "soft", "farmhouse", "velvet"),
        {
            "color": ("beige", "grey", "mustard", "teal", "blush"),
            "size": ("18x18 inch", "20x20 inch", "12x20 inch"),
        },
    ),
    "backpack": (
        "bags",
        (
            "water resistant",
            "laptop compartment",
            "anti theft",
            "lightweight",
            "usb charging port",
            "padded straps",
        ),
        {"color": ("black", "grey", "navy", "camo"), "size": ("20l", "30l", "40l")},
    ),
    "candle": (
        "home",
        ("soy wax", "long lasting", "natural", "lead free", "hand poured", "aromatherapy"),
        {"scent": ("vanilla", "lavender", "sandalwood", "eucalyptus"), "size": ("8 oz", "14 oz", "3 pack")},
    ),
}
BRANDS = ("acme", "nordic", "zenith", "oakly", "bloom", "vertex", "harbor", "lumen", "pioneer", "aurora")
NAV = ("back to search", "next >", "< prev", "description", "features", "reviews", "buy now")

DEFAULTS: dict[str, Any] = {
    "catalog_seed": 0,
    "types": 8,  # product types in the catalog (of 14)
    "products_per_type": 12,
    "page_size": 10,
    "goal_attributes": 2,  # attributes named in an instruction
}


@dataclass(frozen=True)
class Product:
    asin: str
    ptype: str
    category: str
    title: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (dimension, values) in display order
    price: float
    description: str


@functools.lru_cache(maxsize=8)
def build_catalog(catalog_seed: int, types: int, products_per_type: int) -> tuple[Product, ...]:
    """The catalog: ``types`` product types x ``products_per_type`` products, deterministic."""
    rng = random.Random(f"shop-catalog-{catalog_seed}")
    chosen = sorted(rng.sample(sorted(PRODUCT_TYPES), min(types, len(PRODUCT_TYPES))))
    products: list[Product] = []
    used: set[str] = set()
    for ptype in chosen:
        category, attribute_pool, option_pool = PRODUCT_TYPES[ptype]
        for _ in range(products_per_type):
            asin = "b0" + "".join(rng.choice("0123456789abcdefghjkmnpqrstvwxyz") for _ in range(8))
            while asin in used:
                asin = "b0" + "".join(rng.choice("0123456789abcdefghjkmnpqrstvwxyz") for _ in range(8))
            used.add(asin)
            attributes = tuple(sorted(rng.sample(attribute_pool, rng.randint(2, 4))))
            options = []
            for dim, values in option_pool.items():
                keep = set(rng.sample(values, min(len(values), rng.randint(2, 3))))
                options.append((dim, tuple(v for v in values if v in keep)))  # keep the display order
            shown = [a for a in attributes if rng.random() < 0.5]
            title = f"{rng.choice(BRANDS)} {ptype}" + (f", {', '.join(shown)}" if shown else "")
            price = round(rng.uniform(8.0, 95.0), 2)
            description = f"this {ptype} from our {category} range is made to last."
            products.append(
                Product(asin, ptype, category, title, attributes, tuple(options), price, description)
            )
    return tuple(products)


def _tokens(text: str) -> set[str]:
    return set(text.replace(",", " ").split())


def search_products(catalog: tuple[Product, ...], query: str) -> list[Product]:
    """Products ranked by query-token overlap with type, title and attributes (ties: catalog order)."""
    words = _tokens(query)
    scored = []
    for index, product in enumerate(catalog):
        text = _tokens(f"{product.ptype} {product.title} {' '.join(product.attributes)}")
        overlap = len(words & text) + (2 if query == product.ptype else 0)
        if overlap:
            scored.append((-overlap, index, product))
    scored.sort(key=lambda item: item[:2])
    return [product for _, _, product in scored[:50]]  # WebShop shows at most 50 results


def score_purchase(goal: dict[str, Any], product: Product, selected: dict[str, str]) -> float:
    """WebShop's reward r = r_type (|U_att∩Y_att| + |U_opt∩Y_opt| + 1[y_price<=u_price]) / (|U_att|+|U_opt|+1)."""
    if product.ptype == goal["type"]:
        r_type = 1.0
    elif product.category == goal["category"]:
        r_type = 0.5
    else:
        r_type = 0.0
    u_att, u_opt = set(goal["attributes"]), set(goal["options"].values())
    matched = len(u_att & set(product.attributes)) + len(u_opt & set(selected.values()))
    matched += 1 if product.price <= goal["price"] else 0
    return r_type * matched / (len(u_att) + len(u_opt) + 1)


def instruction_text(goal: dict[str, Any]) -> str:
    attributes = ", ".join(goal["attributes"])
    options = ", and ".join(f"{dim}: {value}" for dim, value in goal["options"].items())
    return f"i need a {goal['type']} with {attributes}, and {options}, and price lower than {goal['price']:.2f} dollars"


@dataclass
class _Page:
    kind: str = "search"  # search | results | item | description | features | done
    query: str = ""
    page: int = 1
    item: str = ""
    selected: dict[str, str] = field(default_factory=dict)


class ShopGame:
    """One shopping episode."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.at = _Page()

    def reset(self, task: Task) -> Observation:
        spec = task.spec
        self.catalog = build_catalog(spec["catalog_seed"], spec["types"], spec["products_per_type"])
        self.by_asin = {p.asin: p for p in self.catalog}
        self.goal = spec["goal"]
        self.instruction = spec["instruction"]
        self.queries = sorted({p.ptype for p in self.catalog})
        self._ranked: dict[str, list[Product]] = {}
        self.at = _Page()
        self.score = 0.0
        return self._observation()

    # -- pages ----------------------------------------------------------------------------------
    def _results(self) -> list[Product]:
        query = self.at.query
        if query not in self._ranked:  # pages re-render the same query many times
            self._ranked[query] = search_products(self.catalog, query)
        return self._ranked[query]

    def _shown(self) -> list[Product]:
        start = (self.at.page - 1) * self.page_size
        return self._results()[start : start + self.page_size]

    def _pages(self) -> int:
        return max(1, math.ceil(len(self._results()) / self.page_size))

    def admissible(self) -> list[str]:
        kind = self.at.kind
        if kind == "search":
            return [f"search[{q}]" for q in self.queries]
        if kind == "done":
            return []
        acts = ["click[back to search]"]
        if kind == "results":
            if self.at.page > 1:
                acts.append("click[< prev]")
            if self.at.page < self._pages():
                acts.append("click[next >]")
            acts += [f"click[{p.asin}]" for p in self._shown()]
        elif kind == "item":
            product = self.by_asin[self.at.item]
            acts.append("click[< prev]")
            acts += [f"click[{v}]" for _, values in product.options for v in values]
            acts += ["click[description]", "click[features]", "click[buy now]"]
        else:  # description / features
            acts.append("click[< prev]")
        return acts

    def _text(self) -> str:
        at = self.at
        head = f"Instruction: [SEP] {self.instruction} [SEP] "
        if at.kind == "search":
            return f"WebShop [SEP] {head}Search"
        if at.kind == "done":
            return (
                f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {self.score:.2f}"
            )
        if at.kind == "results":
            total = len(self._results())
            parts = [f"{head}Back to Search [SEP] Page {at.page} (Total results: {total})"]
            if at.page > 1:
                parts.append("< Prev")
            if at.page < self._pages():
                parts.append("Next >")
            for p in self._shown():
                parts += [p.asin, p.title, f"${p.price:.2f}"]
            return " [SEP] ".join(parts)
        product = self.by_asin[at.item]
        if at.kind == "description":
            return f"{head}Back to Search [SEP] < Prev [SEP] {product.description}"
        if at.kind == "features":
            return f"{head}Back to Search [SEP] < Prev [SEP] " + " [SEP] ".join(product.attributes)
        parts = [f"{head}Back to Search [SEP] < Prev"]
        for dim, values in product.options:
            chosen = at.selected.get(dim)
            parts.append(dim)
            parts += [f"{v} (selected)" if v == chosen else v for v in values]
        parts += [
            product.title,
            f"Price: ${product.price:.2f}",
            "Rating: N.A.",
            "Description",
            "Features",
            "Buy Now",
        ]
        return " [SEP] ".join(parts)

    def state_key(self) -> str:
        at = self.at
        selected = ",".join(f"{d}={v}" for d, v in sorted(at.selected.items()))
        return f"page={at.kind}|q={at.query}|p={at.page}|item={at.item}|opts={selected}"

    def _observation(self) -> Observation:
        return Observation(
            text=self._text(),
            admissible=self.admissible(),
            state_key=self.state_key(),
            task_text=self.instruction,
        )

    # -- step -----------------------------------------------------------------------------------
    def step(self, action: str) -> Transition:
        action = " ".join(action.strip().lower().split())
        bought = False
        if action in self.admissible():
            bought = self._apply(action)
        won = bought and abs(self.score - 1.0) < 1e-9
        return Transition(
            observation=self._observation(),
            reward=0.0,
            terminated=bought,
            won=won,
            score=self.score,
            outcome=10.0 if won else 0.0,
        )

    def _apply(self, action: str) -> bool:
        at = self.at
        if action.startswith("search["):
            self.at = _Page(kind="results", query=action[7:-1], page=1)
            return False
        target = action[6:-1]
        if target == "back to search":
            self.at = _Page()
        elif target == "next >":
            at.page += 1
        elif target == "< prev":
            if at.kind == "results":
                at.page -= 1
            elif at.kind == "item":
                self.at = _Page(kind="results", query=at.query, page=at.page)
            else:
                at.kind = "item"
        elif at.kind == "results":
            self.at = _Page(kind="item", query=at.query, page=at.page, item=target)
        elif target in ("description", "features"):
            at.kind = target
        elif target == "buy now":
            product = self.by_asin[at.item]
            self.score = score_purchase(self.goal, product, at.selected)
            at.kind = "done"
            return True
        else:  # an option value of the item
            product = self.by_asin[at.item]
            dim = next(d for d, values in product.options if target in values)
            at.selected = {**at.selected, dim: target}
        return False

    # -- expert ---------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """Search the goal's type, page to the goal product, select the goal options, buy."""
        at, goal = self.at, self.goal
        if at.kind == "done":
            return None
        if at.kind == "search":
            return f"search[{goal['type']}]"
        if at.kind in ("description", "features"):
            return "click[< prev]"
        if at.kind == "item" and at.item != goal["asin"]:
            return "click[< prev]"
        if at.kind == "results":
            ranked = [p.asin for p in self._results()]
            if goal["asin"] not in ranked:
                return "click[back to search]"
            page = ranked.index(goal["asin"]) // self.page_size + 1
            if page > at.page:
                return "click[next >]"
            if page < at.page:
                return "click[< prev]"
            return f"click[{goal['asin']}]"
        for dim, value in goal["options"].items():
            if at.selected.get(dim) != value:
                return f"click[{value}]"
        return "click[buy now]"


class ShopEnv:
    """Task sets and games of the shop."""

    name = ENV_NAME
    prompt_style = "webshop"
    success_outcome = 10.0
    # tasks per split the tiny tokenizer plays by default: 32 cover the catalog's words (docs/rollout.md)
    vocab_tasks = 32

    def __init__(self, max_turns: int, invalid_penalty: float, options: dict[str, Any]) -> None:
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.options = options
        self.catalog = build_catalog(options["catalog_seed"], options["types"], options["products_per_type"])

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        opts = self.options

        def candidate(index: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
            product = rng.choice(self.catalog)
            n_att = min(opts["goal_attributes"], len(product.attributes))
            goal = {
                "asin": product.asin,
                "type": product.ptype,
                "category": product.category,
                "attributes": sorted(rng.sample(product.attributes, n_att)),
                "options": {dim: rng.choice(values) for dim, values in product.options},
                "price": float(10 * math.ceil(product.price / 10) + 10 * rng.randint(0, 2)),
            }
            spec = {
                "catalog_seed": opts["catalog_seed"],
                "types": opts["types"],
                "products_per_type": opts["products_per_type"],
                "goal": goal,
                "instruction": instruction_text(goal),
            }
            return product.category, spec

        return build_task_list(ENV_NAME, split, count, seed, candidate)

    def new_game(self) -> ShopGame:
        return ShopGame(self.options["page_size"])

    def failure_outcome(self, score: float) -> float:
        return 0.0


def make_shop(max_turns: int = 15, invalid_penalty: float = -0.1, data: str = "", **options: Any) -> ShopEnv:
    """Factory for the registry (``data`` is unused: the catalog is generated)."""
    from schemas.errors import GraftError

    opts = check_options(ENV_NAME, options, DEFAULTS)
    if not (opts["types"] >= 1 and opts["products_per_type"] >= 1 and opts["page_size"] >= 1):
        raise GraftError("environment 'shop': need types >= 1, products_per_type >= 1, page_size >= 1")
    if opts["goal_attributes"] < 0:
        raise GraftError("environment 'shop': need goal_attributes >= 0")
    return ShopEnv(max_turns, invalid_penalty, opts)
