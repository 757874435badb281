"""``store``: stateful tool use over a real SQLite database (catalogue, stock, customers, orders).

Why this family: grid and search reward *reaching* something; here the reward is a property of the
final state of a relational database the agent mutates through tools, so partial, duplicated or
out-of-order writes are visible and a wrong write has to be repaired. SQLite (stdlib, in-memory) is
the database rather than dicts so that the goal check is a handful of SQL queries over real tables
and the same queries describe the state to an auditor.

Difficulty axes (the vector the evolution operators and the predictor read):
  * ``ops``          number of required write operations (longer horizon);
  * ``scale``        size of the world: products, customers and existing orders (larger state);
  * ``lookups``      how indirectly the instruction names things: 0 = ids given, 1 = names that
                     must be resolved to ids, 2 = descriptions needing a further hop (the cheapest
                     product of a category, the customer who placed order #n);
  * ``distractors``  look-alike entities in the database plus tempting side requests in the
                     instruction that must *not* be acted on;
  * ``harness``      how much help the episode gives (0: a plan and progress counts, 1: plain
                     observations, 2: terse observations and errors without fix hints).

Distractor *tools* (``apply_discount``, ``refund_order``, ``send_email``) are always present:
TRL builds one tool list per environment class, so a per-difficulty tool set would need generated
subclasses, which neither TRL nor the spec-only rebuild contract handles well. They write to the
database, so calling them when the instruction does not ask for it changes the final state and
fails the episode.

The world is drawn from sub-streams of the seed that do not depend on the difficulty vector, with
each entity drawn independently of how many are kept: raising ``scale`` on a spec *extends* its
world rather than replacing it, which is what "evolving an environment" should mean.
"""

from __future__ import annotations

import random
import re
import sqlite3
from typing import Any, ClassVar

from apprentice.envs import register
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, replay, tool

_ADJ = ["blue", "red", "green", "steel", "oak", "linen", "glass", "black", "white", "copper", "cedar", "wool"]
_NOUN = {
    "kitchen": ["mug", "kettle", "pan", "bowl", "teapot"],
    "office": ["lamp", "stapler", "notebook", "desk", "chair"],
    "garden": ["hose", "trowel", "planter", "bench", "rake"],
    "bath": ["towel", "mirror", "basket", "stool", "soap dish"],
}
_FIRST = ["Ana", "Bob", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun", "Kim", "Lea", "Milo",
          "Nia", "Omar", "Pia", "Raj", "Sol", "Tess", "Uma"]
_LAST = ["Ruiz", "Lee", "Okafor", "Novak", "Silva", "Haddad", "Berg", "Mori", "Kahn", "Costa", "Dube", "Ivanova"]
_CITIES = ["Lyon", "Porto", "Oslo", "Turin", "Ghent", "Cork", "Graz", "Brno", "Split", "Lund", "Basel", "Bergen",
           "Malmo", "Delft", "Aarhus", "Tartu", "Kotor", "Pecs", "Riga", "Vigo", "Bari", "Nancy", "Linz", "Ulm"]
_SIDE_REQUESTS = [
    "The customer mentions an old refund; refunds are handled by another team, so do not refund anything.",
    "Someone suggested giving a discount; no discounts are authorised today.",
    "Do not email customers about this; they will be notified automatically.",
    "A colleague asked for a price review of the garden range; that is out of scope.",
]

MAX_PRODUCTS, MAX_CUSTOMERS, MAX_ORDERS = 28, 18, 14


def _scale_sizes(scale: int) -> tuple[int, int, int]:
    """(products, customers, existing orders) for a ``scale`` level."""
    return 6 + 6 * scale, 4 + 4 * scale, 3 + 3 * scale


def _money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def _as_int(value: Any) -> int | None:
    try:
        return int(str(value).strip().lstrip("#"))
    except (TypeError, ValueError):
        return None


class StoreDB:
    """The in-memory SQLite world plus the write operations shared by tools and the generator.

    Keeping writes here (not in the tool methods) means the generator simulates the oracle plan with
    exactly the semantics the agent's tools have; a test then replays the plan through the tools."""

    SCHEMA = """
    CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT UNIQUE, category TEXT, price_cents INTEGER);
    CREATE TABLE stock (product_id INTEGER PRIMARY KEY REFERENCES products(id), qty INTEGER);
    CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, city TEXT);
    CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, qty INTEGER,
                         status TEXT, discount INTEGER DEFAULT 0);
    CREATE TABLE outbox (id INTEGER PRIMARY KEY, customer_id INTEGER, message TEXT);
    """

    def __init__(self, seed: int, scale: int, distractors: int) -> None:
        self.con = sqlite3.connect(":memory:", check_same_thread=False)
        self.con.executescript(self.SCHEMA)
        n_prod, n_cust, n_ord = _scale_sizes(scale)
        world = random.Random(f"store:{seed}:world")
        names = [f"{a} {n}" for cat in _NOUN for n in _NOUN[cat] for a in _ADJ]
        cat_of = {f"{a} {n}": cat for cat in _NOUN for n in _NOUN[cat] for a in _ADJ}
        world.shuffle(names)
        prices = [world.randint(2, 80) * 50 + world.randint(0, 49) for _ in range(MAX_PRODUCTS)]
        stocks = [world.randint(2, 9) for _ in range(MAX_PRODUCTS)]
        for i in range(n_prod):
            self.con.execute("INSERT INTO products VALUES (?,?,?,?)", (i + 1, names[i], cat_of[names[i]], prices[i]))
            self.con.execute("INSERT INTO stock VALUES (?,?)", (i + 1, stocks[i]))
        people = [(f, last) for f in _FIRST for last in _LAST]
        world.shuffle(people)
        cities = list(_CITIES)
        world.shuffle(cities)
        for i in range(n_cust):
            f, last = people[i]
            self.con.execute("INSERT INTO customers VALUES (?,?,?,?)",
                             (i + 1, f"{f} {last}", f"{f.lower()}.{last.lower()}@example.com", cities[i]))
        picks = [(world.random(), world.random(), world.randint(1, 3)) for _ in range(MAX_ORDERS)]
        for i in range(n_ord):
            c, p, q = picks[i]
            self.con.execute("INSERT INTO orders (id, customer_id, product_id, qty, status) VALUES (?,?,?,?,?)",
                             (i + 1, 1 + int(c * n_cust), 1 + int(p * n_prod), q, "open"))
        # Look-alikes: a second product whose name extends an existing one, a customer sharing a first name.
        look = random.Random(f"store:{seed}:lookalikes")
        for k in range(distractors):
            base_id = look.randint(1, n_prod)
            (bname, bcat), = self.con.execute("SELECT name, category FROM products WHERE id=?", (base_id,))
            pid = self.next_id("products")
            self.con.execute("INSERT INTO products VALUES (?,?,?,?)",
                             (pid, f"{bname} {['XL', 'mini', 'pro'][k % 3]}", bcat, look.randint(2, 80) * 50))
            self.con.execute("INSERT INTO stock VALUES (?,?)", (pid, look.randint(2, 9)))
            cid = self.next_id("customers")
            (cname,), = self.con.execute("SELECT name FROM customers WHERE id=?", (look.randint(1, n_cust),))
            first = cname.split()[0]
            taken = {r[0] for r in self.con.execute("SELECT name FROM customers")}
            last = next(x for x in _LAST[k:] + _LAST[:k] if f"{first} {x}" not in taken)
            self.con.execute("INSERT INTO customers VALUES (?,?,?,?)",
                             (cid, f"{first} {last}", f"{first.lower()}.{last.lower()}{k}@example.com",
                              _CITIES[-1 - k]))
        self.n_initial_orders = n_ord

    def next_id(self, table: str) -> int:
        (m,), = self.con.execute(f"SELECT COALESCE(MAX(id), 0) + 1 FROM {table}")  # noqa: S608 (fixed names)
        return int(m)

    def one(self, sql: str, *args: Any) -> tuple | None:
        return self.con.execute(sql, args).fetchone()

    def row(self, sql: str, *args: Any) -> tuple:
        """Exactly one row (the generator only asks for rows it knows exist)."""
        r = self.con.execute(sql, args).fetchone()
        if r is None:
            raise LookupError(f"store generator: no row for {sql} {args}")
        return tuple(r)

    # ---- writes (return None on success or an error text) ---------------------------------------
    def place(self, customer_id: int, product_id: int, qty: int) -> tuple[int | None, str | None]:
        if self.one("SELECT 1 FROM customers WHERE id=?", customer_id) is None:
            return None, f"no customer with id {customer_id}"
        row = self.one("SELECT qty FROM stock WHERE product_id=?", product_id)
        if row is None:
            return None, f"no product with id {product_id}"
        if qty < 1:
            return None, "quantity must be at least 1"
        if row[0] < qty:
            return None, f"only {row[0]} in stock"
        oid = self.next_id("orders")
        self.con.execute("INSERT INTO orders (id, customer_id, product_id, qty, status) VALUES (?,?,?,?,?)",
                         (oid, customer_id, product_id, qty, "open"))
        self.con.execute("UPDATE stock SET qty = qty - ? WHERE product_id=?", (qty, product_id))
        return oid, None

    def cancel(self, order_id: int) -> str | None:
        row = self.one("SELECT product_id, qty, status FROM orders WHERE id=?", order_id)
        if row is None:
            return f"no order with id {order_id}"
        if row[2] != "open":
            return f"order {order_id} is {row[2]}, not open"
        self.con.execute("UPDATE orders SET status='cancelled' WHERE id=?", (order_id,))
        self.con.execute("UPDATE stock SET qty = qty + ? WHERE product_id=?", (row[1], row[0]))
        return None

    def restock(self, product_id: int, qty: int) -> str | None:
        if self.one("SELECT 1 FROM stock WHERE product_id=?", product_id) is None:
            return f"no product with id {product_id}"
        if qty < 1:
            return "quantity must be at least 1"
        self.con.execute("UPDATE stock SET qty = qty + ? WHERE product_id=?", (qty, product_id))
        return None

    def snapshot(self) -> tuple:
        """The state the goal is checked on. New orders are compared without their ids (the agent may
        place them in any order) and new orders it cancelled again are ignored (a repaired mistake)."""
        q = self.con.execute
        return (
            tuple(q("SELECT product_id, qty FROM stock ORDER BY product_id")),
            tuple(q("SELECT id, price_cents FROM products ORDER BY id")),
            tuple(q("SELECT id, status, discount FROM orders WHERE id<=? ORDER BY id", (self.n_initial_orders,))),
            tuple(q("SELECT customer_id, product_id, qty, status, discount FROM orders WHERE id>? "
                    "AND status!='cancelled' ORDER BY customer_id, product_id, qty", (self.n_initial_orders,))),
            tuple(q("SELECT customer_id, message FROM outbox ORDER BY id")),
        )


@register
class StoreEnv(Environment):
    """A shop back-office: resolve the instruction to ids, then make the required database writes."""

    family: ClassVar[str] = "store"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("ops", 1, 6, "required write operations"),
        DifficultyAxis("scale", 0, 3, "world size: products/customers/orders"),
        DifficultyAxis("lookups", 0, 2, "indirection of references in the instruction"),
        DifficultyAxis("distractors", 0, 3, "look-alike entities and tempting side requests"),
        DifficultyAxis("harness", 0, 2, "0 = plan + progress, 2 = terse observations"),
    )
    system_prompt: ClassVar[str] = (
        "You are a shop back-office agent. Use the tools to make exactly the changes the instruction "
        "asks for, nothing else."
    )

    def __init__(self) -> None:
        super().__init__()
        self._db: StoreDB | None = None
        self._target: tuple = ()
        self._plan: list[ToolCall] = []
        self._n_ops = 0

    # ---- generation ---------------------------------------------------------------------------
    @classmethod
    def generate(cls, seed: int, level: int | None = None, generation: int = 0) -> ProblemSpec:
        """A spec whose oracle plan scores 1.0 (seeds are stepped until one does)."""
        for attempt in range(100):
            s = seed + attempt * 1_000_003
            spec = cls.make_spec(s, cls.sample_difficulty(random.Random(s), level), generation)
            if replay(cls, spec, cls.oracle_plan(spec)) == 1.0:
                return spec
        raise RuntimeError(f"store: no solvable problem near seed {seed} at level {level}")

    @classmethod
    def oracle_plan(cls, spec: ProblemSpec) -> list[ToolCall]:
        env = cls()
        env.reset(spec=spec)
        return env.oracle()

    # ---- episode ------------------------------------------------------------------------------
    def build(self, spec: ProblemSpec) -> str:
        d = {k: int(v) for k, v in spec.difficulty.items()}
        self._harness = d["harness"]
        self._db = StoreDB(spec.seed, d["scale"], d["distractors"])
        sim = StoreDB(spec.seed, d["scale"], d["distractors"])
        rng = spec.rng()
        lines, plan = [], []
        for _ in range(d["ops"]):
            text, calls = self._draw_op(sim, rng, d["lookups"])
            lines.append(text)
            plan.extend(calls)
        self._plan, self._n_ops = plan, d["ops"]
        self._target = sim.snapshot()
        sim.con.close()
        side = rng.sample(_SIDE_REQUESTS, min(d["distractors"], len(_SIDE_REQUESTS)))
        task = "Instruction:\n" + "\n".join(f"{i + 1}. {t}" for i, t in enumerate(lines))
        if side:
            task += "\nNotes: " + " ".join(side)
        if self._harness == 0:
            task += ("\nPlan: resolve every product and customer to its id with the look-up tools "
                     "(find_product, find_customer, list_products, get_order, list_orders), then make the "
                     "writes in the order given. Make no other changes.")
        return task

    def _ref_product(self, sim: StoreDB, rng: random.Random, pid: int, lookups: int) -> tuple[str, list[ToolCall]]:
        name, cat, price = sim.row("SELECT name, category, price_cents FROM products WHERE id=?", pid)
        if lookups >= 2:
            rows = sim.con.execute("SELECT id, price_cents FROM products WHERE category=? ORDER BY price_cents",
                                   (cat,)).fetchall()
            if rows[0][0] == pid and (len(rows) == 1 or rows[1][1] > rows[0][1]):
                return f"the cheapest product in the '{cat}' category", [ToolCall("list_products", {"category": cat})]
        if lookups >= 1:
            return f"the {name}", [ToolCall("find_product", {"query": name})]
        return f"product #{pid} ({name})", []

    def _ref_customer(self, sim: StoreDB, rng: random.Random, cid: int, lookups: int) -> tuple[str, list[ToolCall]]:
        (name,) = sim.row("SELECT name FROM customers WHERE id=?", cid)
        if lookups >= 2:
            row = sim.one("SELECT MIN(id) FROM orders WHERE customer_id=? AND id<=?", cid, sim.n_initial_orders)
            if row and row[0] is not None:
                return f"the customer who placed order #{row[0]}", [ToolCall("get_order", {"order_id": row[0]})]
        if lookups >= 1:
            return name, [ToolCall("find_customer", {"query": name})]
        return f"customer #{cid} ({name})", []

    def _draw_op(self, sim: StoreDB, rng: random.Random, lookups: int) -> tuple[str, list[ToolCall]]:
        """One required write: its instruction line and the oracle calls (look-ups + write)."""
        (n_prod,), = sim.con.execute("SELECT COUNT(*) FROM products")
        (n_cust,), = sim.con.execute("SELECT COUNT(*) FROM customers")
        open_orders = [r[0] for r in sim.con.execute("SELECT id FROM orders WHERE status='open' AND id<=?",
                                                     (sim.n_initial_orders,))]
        kind = rng.choice(["place", "place", "restock"] + (["cancel"] if open_orders else []))
        if kind == "cancel":
            oid = rng.choice(open_orders)
            cid, pid = sim.row("SELECT customer_id, product_id FROM orders WHERE id=?", oid)
            assert sim.cancel(oid) is None
            if lookups == 0:
                return f"Cancel order #{oid}.", [ToolCall("cancel_order", {"order_id": oid})]
            (pname,) = sim.row("SELECT name FROM products WHERE id=?", pid)
            cref, ccalls = self._ref_customer(sim, rng, cid, min(lookups, 1))
            # The goal is one specific order: describe it as the customer's earliest order of that
            # product, and fall back to the id when that description would point at another order.
            (first,) = sim.row("SELECT MIN(id) FROM orders WHERE customer_id=? AND product_id=? AND id<=?",
                               cid, pid, sim.n_initial_orders)
            if first != oid:
                return f"Cancel order #{oid}.", [ToolCall("cancel_order", {"order_id": oid})]
            calls = [*ccalls, ToolCall("list_orders", {"customer_id": cid}), ToolCall("cancel_order", {"order_id": oid})]
            return f"Cancel {cref}'s earliest order of the {pname}.", calls
        pid = rng.randint(1, n_prod)
        pref, pcalls = self._ref_product(sim, rng, pid, lookups)
        if kind == "restock":
            qty = rng.randint(2, 9)
            assert sim.restock(pid, qty) is None
            return (f"Add {qty} units to the stock of {pref}.",
                    [*pcalls, ToolCall("restock", {"product_id": pid, "quantity": qty})])
        cid = rng.randint(1, n_cust)
        cref, ccalls = self._ref_customer(sim, rng, cid, lookups)
        (have,) = sim.row("SELECT qty FROM stock WHERE product_id=?", pid)
        qty = rng.randint(1, 4)
        calls = [*pcalls, *ccalls]
        text = f"Order {qty} x {pref} for {cref}."
        if have < qty:  # the shortfall must be restocked first: one more op-dependent step
            extra = qty - have + rng.randint(0, 3)
            assert sim.restock(pid, extra) is None
            calls.append(ToolCall("restock", {"product_id": pid, "quantity": extra}))
            text = f"Restock {pref} by {extra} units, then order {qty} of it for {cref}."
        oid, err = sim.place(cid, pid, qty)
        assert err is None, err
        calls.append(ToolCall("place_order", {"customer_id": cid, "product_id": pid, "quantity": qty}))
        return text, calls

    def oracle(self) -> list[ToolCall]:
        return list(self._plan)

    def turn_budget(self) -> int:
        return len(self._plan) + 3

    def ungrounded(self, call: ToolCall, seen: str) -> str:
        """Every id argument must have been shown (``#<id>``) by the task or an earlier look-up: the
        ids are what the look-up tools exist to find."""
        shown = set(re.findall(r"#(\d+)", seen))
        for key in ("product_id", "customer_id", "order_id"):
            if key in call.arguments:
                v = _as_int(call.arguments[key])
                if v is not None and str(v) not in shown:
                    return f"{call.name}({key}={v}) uses an id no earlier observation showed"
        return ""

    # ---- observation helpers ------------------------------------------------------------------
    def _err(self, text: str, hint: str = "") -> str:
        if self._harness >= 2:
            return "Error."
        return f"Error: {text}." + (f" {hint}" if hint and self._harness == 0 else "")

    def _after_write(self, text: str) -> str:
        assert self._db is not None
        if self._db.snapshot() == self._target:
            self.reward, self.done = 1.0, True
            return "OK." if self._harness >= 2 else f"{text} All requested changes are done."
        if self._harness >= 2:
            return "OK."
        return text

    def _db_or_none(self) -> StoreDB:
        if self._db is None:
            raise RuntimeError("call reset(spec=...) before using the tools")
        return self._db

    # ---- look-up tools ------------------------------------------------------------------------
    @tool
    def find_product(self, query: str) -> str:
        """Find products whose name contains the query.

        Args:
            query: Part of a product name, e.g. "blue mug".
        """
        db = self._db_or_none()
        rows = db.con.execute("SELECT p.id, p.name, p.price_cents, s.qty FROM products p JOIN stock s "
                              "ON s.product_id=p.id WHERE p.name LIKE ? ORDER BY p.id LIMIT 5",
                              (f"%{str(query).strip()}%",)).fetchall()
        if not rows:
            return self._err(f"no product matches '{query}'", "Try a shorter query or list_products(category).")
        return "; ".join(f"#{i} {n} {_money(c)} stock {q}" for i, n, c, q in rows)

    @tool
    def list_products(self, category: str) -> str:
        """List the products of a category with their prices.

        Args:
            category: One of kitchen, office, garden, bath.
        """
        db = self._db_or_none()
        rows = db.con.execute("SELECT id, name, price_cents FROM products WHERE category=? ORDER BY id",
                              (str(category).strip().lower(),)).fetchall()
        if not rows:
            return self._err(f"no category '{category}'", f"Categories: {', '.join(_NOUN)}.")
        return "; ".join(f"#{i} {n} {_money(c)}" for i, n, c in rows)

    @tool
    def check_stock(self, product_id: int) -> str:
        """Units in stock of a product.

        Args:
            product_id: The product's id.
        """
        row = self._db_or_none().one("SELECT qty FROM stock WHERE product_id=?", _as_int(product_id))
        return self._err(f"no product with id {product_id}") if row is None else f"{row[0]} in stock"

    @tool
    def find_customer(self, query: str) -> str:
        """Find customers whose name or email contains the query.

        Args:
            query: Part of a name or email.
        """
        q = f"%{str(query).strip()}%"
        rows = self._db_or_none().con.execute("SELECT id, name, email, city FROM customers WHERE name LIKE ? "
                                              "OR email LIKE ? ORDER BY id LIMIT 5", (q, q)).fetchall()
        if not rows:
            return self._err(f"no customer matches '{query}'", "Try the last name only.")
        return "; ".join(f"#{i} {n} <{e}> {c}" for i, n, e, c in rows)

    @tool
    def get_order(self, order_id: int) -> str:
        """Show one order.

        Args:
            order_id: The order's id.
        """
        row = self._db_or_none().one("SELECT o.id, o.customer_id, c.name, o.product_id, p.name, o.qty, o.status "
                                     "FROM orders o JOIN customers c ON c.id=o.customer_id JOIN products p "
                                     "ON p.id=o.product_id WHERE o.id=?", _as_int(order_id))
        if row is None:
            return self._err(f"no order with id {order_id}")
        return f"order #{row[0]}: customer #{row[1]} {row[2]}, {row[5]} x #{row[3]} {row[4]}, {row[6]}"

    @tool
    def list_orders(self, customer_id: int) -> str:
        """List a customer's orders.

        Args:
            customer_id: The customer's id.
        """
        rows = self._db_or_none().con.execute(
            "SELECT o.id, p.name, o.qty, o.status FROM orders o JOIN products p ON p.id=o.product_id "
            "WHERE o.customer_id=? ORDER BY o.id", (_as_int(customer_id),)).fetchall()
        if not rows:
            return "no orders"
        return "; ".join(f"#{i} {q} x {n} {s}" for i, n, q, s in rows)

    # ---- write tools --------------------------------------------------------------------------
    @tool
    def place_order(self, customer_id: int, product_id: int, quantity: int) -> str:
        """Place an order; it takes the units out of stock.

        Args:
            customer_id: The customer's id.
            product_id: The product's id.
            quantity: Units to order (at least 1, at most the stock).
        """
        c, p, q = _as_int(customer_id), _as_int(product_id), _as_int(quantity)
        if None in (c, p, q):
            return self._err("ids and quantity must be integers")
        oid, err = self._db_or_none().place(c, p, q)  # type: ignore[arg-type]
        if err:
            return self._err(err, "Restock first or check the ids with the look-up tools.")
        return self._after_write(f"Order #{oid} placed.")

    @tool
    def restock(self, product_id: int, quantity: int) -> str:
        """Add units to a product's stock.

        Args:
            product_id: The product's id.
            quantity: Units to add (at least 1).
        """
        p, q = _as_int(product_id), _as_int(quantity)
        if None in (p, q):
            return self._err("product_id and quantity must be integers")
        err = self._db_or_none().restock(p, q)  # type: ignore[arg-type]
        return self._err(err) if err else self._after_write(f"Stock of #{p} raised by {q}.")

    @tool
    def cancel_order(self, order_id: int) -> str:
        """Cancel an open order; its units go back to stock.

        Args:
            order_id: The order's id.
        """
        o = _as_int(order_id)
        err = self._db_or_none().cancel(o) if o is not None else "order_id must be an integer"
        return self._err(err, "Use list_orders(customer_id) to find open orders.") if err else \
            self._after_write(f"Order #{o} cancelled.")

    # ---- distractor tools: real writes, never needed ------------------------------------------
    @tool
    def apply_discount(self, order_id: int, percent: int) -> str:
        """Apply a percentage discount to an order.

        Args:
            order_id: The order's id.
            percent: Discount in percent (1-50).
        """
        db, o, pc = self._db_or_none(), _as_int(order_id), _as_int(percent)
        if o is None or pc is None or db.one("SELECT 1 FROM orders WHERE id=?", o) is None:
            return self._err(f"no order with id {order_id}")
        db.con.execute("UPDATE orders SET discount=? WHERE id=?", (max(1, min(50, pc)), o))
        return self._after_write(f"Discount applied to order #{o}.")

    @tool
    def refund_order(self, order_id: int) -> str:
        """Refund an order (marks it refunded).

        Args:
            order_id: The order's id.
        """
        db, o = self._db_or_none(), _as_int(order_id)
        if o is None or db.one("SELECT 1 FROM orders WHERE id=?", o) is None:
            return self._err(f"no order with id {order_id}")
        db.con.execute("UPDATE orders SET status='refunded' WHERE id=?", (o,))
        return self._after_write(f"Order #{o} refunded.")

    @tool
    def send_email(self, customer_id: int, message: str) -> str:
        """Send an email to a customer.

        Args:
            customer_id: The customer's id.
            message: The text to send.
        """
        db, c = self._db_or_none(), _as_int(customer_id)
        if c is None or db.one("SELECT 1 FROM customers WHERE id=?", c) is None:
            return self._err(f"no customer with id {customer_id}")
        db.con.execute("INSERT INTO outbox (customer_id, message) VALUES (?,?)", (c, str(message)[:200]))
        return self._after_write("Email queued.")
