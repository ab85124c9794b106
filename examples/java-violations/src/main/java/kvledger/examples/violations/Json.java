package kvledger.examples.violations;

import java.util.Map;

/** The little JSON this program writes (flat objects of strings, numbers, null) and reads (one string field). */
final class Json {
    private Json() {}

    static String write(Map<String, ?> object) {
        StringBuilder out = new StringBuilder();
        writeObject(out, object);
        return out.toString();
    }

    private static void writeObject(StringBuilder out, Map<?, ?> object) {
        out.append('{');
        String separator = "";
        for (Map.Entry<?, ?> entry : object.entrySet()) {
            out.append(separator);
            writeString(out, entry.getKey().toString());
            out.append(": ");
            writeValue(out, entry.getValue());
            separator = ", ";
        }
        out.append('}');
    }

    private static void writeValue(StringBuilder out, Object value) {
        if (value == null) {
            out.append("null");
        } else if (value instanceof Number || value instanceof Boolean) {
            out.append(value);
        } else if (value instanceof Map<?, ?> map) {
            writeObject(out, map);
        } else {
            writeString(out, value.toString());
        }
    }

    private static void writeString(StringBuilder out, String text) {
        out.append('"');
        for (int i = 0; i < text.length(); i++) {
            char c = text.charAt(i);
            switch (c) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (c < 0x20) {
                        out.append(String.format("\\u%04x", (int) c));
                    } else {
                        out.append(c);
                    }
                }
            }
        }
        out.append('"');
    }

    /**
     * The string value of the top-level {@code name} field of a JSON object, or null when it has
     * none. Enough for a Schema Registry's answers, whose other fields hold no such key.
     */
    static String readStringField(String json, String name) {
        String key = "\"" + name + "\"";
        int at = json.indexOf(key);
        while (at >= 0) {
            int i = skipSpace(json, at + key.length());
            if (i < json.length() && json.charAt(i) == ':') {
                i = skipSpace(json, i + 1);
                return i < json.length() && json.charAt(i) == '"' ? readString(json, i + 1) : null;
            }
            at = json.indexOf(key, at + 1);
        }
        return null;
    }

    private static int skipSpace(String json, int i) {
        while (i < json.length() && Character.isWhitespace(json.charAt(i))) {
            i++;
        }
        return i;
    }

    private static String readString(String json, int i) {
        StringBuilder out = new StringBuilder();
        while (i < json.length()) {
            char c = json.charAt(i++);
            if (c == '"') {
                return out.toString();
            }
            if (c != '\\') {
                out.append(c);
                continue;
            }
            if (i >= json.length()) {
                break;
            }
            char escaped = json.charAt(i++);
            switch (escaped) {
                case 'b' -> out.append('\b');
                case 'f' -> out.append('\f');
                case 'n' -> out.append('\n');
                case 'r' -> out.append('\r');
                case 't' -> out.append('\t');
                case 'u' -> {
                    if (i + 4 > json.length()) {
                        return null;
                    }
                    try {
                        out.append((char) Integer.parseInt(json.substring(i, i + 4), 16));
                    } catch (NumberFormatException e) {
                        return null;
                    }
                    i += 4;
                }
                default -> out.append(escaped); // \" \\ \/
            }
        }
        return null; // unterminated
    }
}
