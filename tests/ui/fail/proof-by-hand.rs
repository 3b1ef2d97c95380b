use dblock::Held;

fn post(_held: Held<'_>) {}

fn main() {
    // Only the library makes proofs: no constructor, no `Default`.
    post(Held::default());
    post(Held::new(&[]));
}
