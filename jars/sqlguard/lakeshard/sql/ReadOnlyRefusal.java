package lakeshard.sql;

/** A statement the endpoint refuses (its message goes back to the client). */
public final class ReadOnlyRefusal extends IllegalArgumentException {
    public ReadOnlyRefusal(String message) {
        super(message);
    }
}
